// The chat page: conversations, settings, streaming replies with their timings.
// Model text only ever reaches the page as text nodes (see markdown.js).

import { ApiError, modelName, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  sidebar: $("sidebar"), scrim: $("scrim"), chatList: $("chat-list"), newChat: $("new-chat"),
  toggleSidebar: $("toggle-sidebar"), toggleSettings: $("toggle-settings"), settings: $("settings"),
  model: $("model-name"), notice: $("notice"), messages: $("messages"), empty: $("empty"),
  composer: $("composer"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  system: $("system-prompt"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), apiKey: $("api-key"),
};

const state = {
  chats: store.loadChats(),
  current: null,
  settings: store.loadSettings(),
  apiKey: store.loadApiKey(),
  model: null,
  controller: null, // the AbortController of the reply being streamed
  noticeKind: null,
  retry: 0, // the timer that looks for an unreachable server again
};

// ---------------------------------------------------------------- small helpers

function el(tag, className, children = []) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

function button(label, className, onClick) {
  const b = el("button", className, [label]);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

async function copyText(text, source) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API outside a secure context (a LAN address over http): the old way
    const area = el("textarea", "offscreen");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  source.textContent = "Copied";
  setTimeout(() => (source.textContent = "Copy"), 1500);
}

function showNotice(message, kind) {
  ui.notice.textContent = message;
  ui.notice.hidden = false;
  state.noticeKind = kind;
}

function clearNotice(kind) {
  if (kind && state.noticeKind !== kind) return;
  ui.notice.hidden = true;
  state.noticeKind = null;
}

function persist() {
  store.saveChats(state.chats);
  store.saveCurrent(state.current.id);
}

// ---------------------------------------------------------------- messages

function formatStats(stats) {
  const parts = [];
  if (stats.ttft_ms !== null) parts.push(`${Math.round(stats.ttft_ms)} ms to first token`);
  if (stats.tokens_per_s !== null) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  parts.push(`${stats.tokens} tokens`, `finish: ${stats.finish}`);
  return parts.join(" · ");
}

function renderBody(node, message) {
  const body = node.querySelector(".body");
  if (message.role === "assistant") body.replaceChildren(renderMarkdown(message.content, copyText));
  else body.textContent = message.content;
  node.querySelector(".stats").textContent = message.stats ? formatStats(message.stats) : "";
  node.classList.toggle("pending", message.role === "assistant" && !message.stats);
}

function messageNode(message) {
  const who = message.role === "user" ? "You" : state.model || "Model";
  const copy = button("Copy", "copy", (event) => copyText(message.content, event.currentTarget));
  const node = el("article", `msg ${message.role}`, [
    el("div", "role", [who]),
    el("div", "body"),
    el("footer", "meta", [el("span", "stats"), copy]),
  ]);
  renderBody(node, message);
  return node;
}

function nearBottom() {
  const m = ui.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function scrollDown() {
  ui.messages.scrollTop = ui.messages.scrollHeight;
}

function renderMessages() {
  const nodes = state.current.messages.map(messageNode);
  ui.empty.hidden = nodes.length > 0;
  ui.messages.replaceChildren(ui.empty, ...nodes);
  scrollDown();
}

// ---------------------------------------------------------------- chats

function renderChatList() {
  const items = state.chats
    .filter((chat) => chat.messages.length > 0) // "+ New chat" stands for the empty one
    .sort((a, b) => b.updated - a.updated)
    .map((chat) => {
      const open = button(chat.title || "New chat", "open", () => switchTo(chat));
      const remove = button("×", "remove", () => removeChat(chat));
      remove.setAttribute("aria-label", `Delete “${chat.title}”`);
      const item = el("li", chat === state.current ? "current" : "", [open, remove]);
      return item;
    });
  ui.chatList.replaceChildren(...items);
}

function switchTo(chat) {
  if (state.controller) return; // a reply is streaming: Stop it first
  state.current = chat;
  persist();
  renderChatList();
  renderMessages();
  document.body.classList.remove("sidebar-open");
  ui.scrim.hidden = true;
  ui.prompt.focus();
}

function startNewChat() {
  const empty = state.chats.find((c) => c.messages.length === 0);
  const chat = empty || store.newChat();
  if (!empty) state.chats.push(chat);
  switchTo(chat);
}

function removeChat(chat) {
  if (state.controller) return;
  state.chats = state.chats.filter((c) => c !== chat);
  if (chat === state.current) startNewChat();
  else {
    persist();
    renderChatList();
  }
}

// ---------------------------------------------------------------- sending

function requestBody(messages) {
  const s = state.settings;
  const turns = messages.map(({ role, content }) => ({ role, content }));
  const body = { model: state.model, messages: s.system.trim() ? [{ role: "system", content: s.system }, ...turns] : turns };
  if (s.temperature !== "") body.temperature = Number(s.temperature);
  if (s.top_p !== "") body.top_p = Number(s.top_p);
  if (s.max_tokens !== "") body.max_tokens = Number(s.max_tokens);
  return body;
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.newChat.disabled = busy;
  ui.chatList.classList.toggle("locked", busy);
}

/** Streams one reply into `reply`, re-rendering at most once per frame; returns its stats. */
async function stream(reply, node, history) {
  const started = performance.now();
  let first = null;
  let chunks = 0;
  let usage = null;
  let finish = "stop";
  let frame = 0;
  const paint = () => {
    frame = 0;
    const follow = nearBottom();
    renderBody(node, reply);
    if (follow) scrollDown();
  };
  state.controller = new AbortController();
  try {
    for await (const chunk of streamChat(requestBody(history), state.apiKey, state.controller.signal)) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      const delta = choice?.delta?.content;
      if (delta) {
        first ??= performance.now();
        chunks += 1;
        reply.content += delta;
        frame ||= requestAnimationFrame(paint);
      }
      if (choice?.finish_reason) finish = choice.finish_reason;
    }
  } catch (err) {
    if (err.name !== "AbortError") throw err;
    finish = "stopped";
  } finally {
    cancelAnimationFrame(frame);
    state.controller = null;
  }
  // tokens/s over the whole reply, from sending to the last token: honest also when the
  // network delivers a short reply in one piece
  const seconds = (performance.now() - started) / 1000;
  const tokens = usage ? usage.completion_tokens : chunks;
  return {
    ttft_ms: first === null ? null : first - started,
    tokens,
    tokens_per_s: tokens > 0 ? tokens / seconds : null,
    finish,
  };
}

function explain(err) {
  if (err instanceof ApiError) {
    showNotice(err.message, err.kind);
    if (err.kind === "key") openSettings(ui.apiKey);
    if (err.kind === "unreachable") offline();
  } else {
    showNotice(`Something went wrong: ${err.message}`, "server");
  }
}

async function send() {
  const text = ui.prompt.value.trim();
  if (!text || state.controller) return;
  if (!state.model && !(await loadModel())) return;
  const chat = state.current;
  const user = { role: "user", content: text };
  const reply = { role: "assistant", content: "", stats: null };
  chat.messages.push(user, reply);
  chat.title ||= text.slice(0, 60);
  chat.updated = Date.now();
  ui.prompt.value = "";
  autosize();
  ui.empty.hidden = true;
  const node = messageNode(reply);
  ui.messages.append(messageNode(user), node);
  scrollDown();
  persist();
  renderChatList();
  setBusy(true);
  try {
    reply.stats = await stream(reply, node, chat.messages.slice(0, -1));
    clearNotice();
  } catch (err) {
    explain(err);
    if (reply.content === "") {
      // nothing came back: take the turn back and give the text back to the composer
      chat.messages.splice(chat.messages.indexOf(user), 2);
      ui.prompt.value = text;
      autosize();
      renderMessages();
      setBusy(false);
      persist();
      renderChatList();
      return;
    }
    reply.stats = { ttft_ms: null, tokens: 0, tokens_per_s: null, finish: "error" };
  }
  setBusy(false);
  renderBody(node, reply);
  if (nearBottom()) scrollDown();
  persist();
  ui.prompt.focus();
}

function stop() {
  state.controller?.abort(); // closes the connection: the server cancels and frees the pages
}

// ---------------------------------------------------------------- server and settings

async function loadModel() {
  clearTimeout(state.retry);
  try {
    state.model = await modelName(state.apiKey);
    ui.model.textContent = state.model;
    ui.model.classList.add("online");
    clearNotice("key");
    clearNotice("unreachable");
    return true;
  } catch (err) {
    state.model = null;
    ui.model.textContent = "not connected";
    ui.model.classList.remove("online");
    explain(err);
    return false;
  }
}

/** The server is gone: say so in the top bar and look for it again every few seconds. */
function offline() {
  ui.model.classList.remove("online");
  clearTimeout(state.retry);
  state.retry = setTimeout(loadModel, 3000);
}

function openSettings(focus) {
  ui.settings.hidden = false;
  ui.toggleSettings.setAttribute("aria-expanded", "true");
  focus?.focus();
}

function bindSettings() {
  const fields = [
    [ui.system, "system"],
    [ui.temperature, "temperature"],
    [ui.topP, "top_p"],
    [ui.maxTokens, "max_tokens"],
  ];
  for (const [input, name] of fields) {
    input.value = state.settings[name];
    input.addEventListener("input", () => {
      state.settings[name] = input.value;
      store.saveSettings(state.settings);
    });
  }
  ui.apiKey.value = state.apiKey;
  ui.apiKey.addEventListener("change", () => {
    state.apiKey = ui.apiKey.value.trim();
    store.saveApiKey(state.apiKey);
    loadModel();
  });
  ui.toggleSettings.addEventListener("click", () => {
    if (ui.settings.hidden) openSettings();
    else {
      ui.settings.hidden = true;
      ui.toggleSettings.setAttribute("aria-expanded", "false");
    }
  });
}

function autosize() {
  ui.prompt.style.height = "auto";
  ui.prompt.style.height = `${Math.min(ui.prompt.scrollHeight, 200)}px`;
}

function bindComposer() {
  ui.composer.addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    } else if (event.key === "Escape") stop();
  });
  ui.prompt.addEventListener("input", autosize);
  ui.stop.addEventListener("click", stop);
  ui.newChat.addEventListener("click", startNewChat);
  const toggleSidebar = (open) => {
    document.body.classList.toggle("sidebar-open", open);
    ui.scrim.hidden = !open;
  };
  ui.toggleSidebar.addEventListener("click", () => toggleSidebar(!document.body.classList.contains("sidebar-open")));
  ui.scrim.addEventListener("click", () => toggleSidebar(false));
}

function start() {
  const saved = state.chats.find((c) => c.id === store.loadCurrent());
  state.current = saved || store.newChat();
  if (!saved) state.chats.push(state.current);
  bindSettings();
  bindComposer();
  renderChatList();
  renderMessages();
  loadModel();
  ui.prompt.focus();
}

start();
