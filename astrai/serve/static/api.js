// The two API calls the page makes, and what their failures mean to a person.

/** A failure the page explains: kind is "key", "busy", "unreachable" or "server". */
export class ApiError extends Error {
  constructor(kind, message) {
    super(message);
    this.kind = kind;
  }
}

function headers(apiKey) {
  const h = { "content-type": "application/json" };
  if (apiKey) h.authorization = `Bearer ${apiKey}`;
  return h;
}

async function failure(response, sentKey) {
  let detail = "";
  try {
    detail = (await response.json()).error?.message ?? "";
  } catch {
    // not JSON: the status says enough
  }
  if (response.status === 401 || response.status === 403) {
    const message = sentKey
      ? "The server refused this API key. Check it in Settings."
      : "This server needs an API key. Enter it in Settings; it is kept in this browser only.";
    return new ApiError("key", message);
  }
  if (response.status === 429 || response.status === 529 || response.status === 503) {
    return new ApiError("busy", `The server is overloaded (HTTP ${response.status}). Try again in a moment.`);
  }
  return new ApiError("server", `The server answered HTTP ${response.status}${detail ? `: ${detail}` : "."}`);
}

async function call(path, init) {
  let response;
  try {
    response = await fetch(path, init);
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError("unreachable", `Cannot reach the server at ${location.origin}. Is \`just serve\` still running?`);
  }
  if (!response.ok) throw await failure(response, "authorization" in init.headers);
  return response;
}

/** The name of the model this server serves. */
export async function modelName(apiKey) {
  const response = await call("/v1/models", { headers: headers(apiKey) });
  const body = await response.json();
  return body.data[0].id;
}

/** Server-sent events of a streamed chat completion, parsed: yields each chunk object.
 *  Aborting `signal` closes the connection, which cancels the request on the server. */
export async function* streamChat(body, apiKey, signal) {
  const response = await call("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    let step;
    try {
      step = await reader.read();
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError("unreachable", "The connection to the server broke off mid-reply.");
    }
    if (step.done) return;
    buffer += step.value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError("server", chunk.error.message ?? "The server failed mid-reply.");
      yield chunk;
    }
  }
}
