// Markdown -> DOM nodes, for untrusted model output.
//
// Every piece of the text becomes a text node (textContent) inside elements this file
// creates itself: no HTML string is ever parsed, so `<script>` or `<img onerror=...>` in a
// reply is shown as the characters it is made of. Links keep only http(s) targets.
// Covered: fenced code blocks (also unclosed, while a reply streams), headings, lists,
// block quotes, rules, paragraphs with line breaks, `code`, **bold**, *italic*, [links](https://...).

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const INLINE =
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*(?!\*)|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/;

function el(tag, className, children = []) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  node.append(...children);
  return node;
}

/** Inline spans of one line of text, as nodes. */
export function inline(text) {
  const nodes = [];
  let rest = text;
  for (let m = INLINE.exec(rest); m; m = INLINE.exec(rest)) {
    if (m.index > 0) nodes.push(document.createTextNode(rest.slice(0, m.index)));
    if (m[1]) nodes.push(el("code", null, [m[2]]));
    else if (m[3] !== undefined) nodes.push(el("strong", null, inline(m[3])));
    else if (m[4] !== undefined) nodes.push(el("em", null, inline(m[4])));
    else {
      const link = el("a", null, inline(m[5]));
      link.href = m[6];
      link.target = "_blank";
      link.rel = "noopener noreferrer";
      nodes.push(link);
    }
    rest = rest.slice(m.index + m[0].length);
  }
  if (rest) nodes.push(document.createTextNode(rest));
  return nodes;
}

function lines(texts) {
  const nodes = [];
  texts.forEach((t, i) => {
    if (i > 0) nodes.push(document.createElement("br"));
    nodes.push(...inline(t));
  });
  return nodes;
}

/** A code block with its language and a copy button; `onCopy(text)` copies. */
function codeBlock(lang, code, onCopy) {
  const copy = el("button", "copy", ["Copy"]);
  copy.type = "button";
  copy.addEventListener("click", () => onCopy(code, copy));
  const bar = el("div", "code-bar", [el("span", "lang", [lang || "text"]), copy]);
  return el("div", "code-block", [bar, el("pre", null, [el("code", null, [code])])]);
}

function list(items, ordered, start) {
  const node = el(ordered ? "ol" : "ul", null, items.map((t) => el("li", null, inline(t))));
  if (ordered && start !== 1) node.start = start;
  return node;
}

/** The whole text as a DocumentFragment of block elements. */
export function renderMarkdown(text, onCopy) {
  const out = document.createDocumentFragment();
  const src = text.replace(/\r\n?/g, "\n").split("\n");
  let paragraph = [];
  const flush = () => {
    if (paragraph.length) out.append(el("p", null, lines(paragraph)));
    paragraph = [];
  };
  for (let i = 0; i < src.length; ) {
    const line = src[i];
    let m;
    if ((m = FENCE.exec(line))) {
      flush();
      const body = [];
      const close = new RegExp(`^\\s*${m[1][0]}{${m[1].length},}\\s*$`);
      for (i += 1; i < src.length && !close.test(src[i]); i += 1) body.push(src[i]);
      if (i >= src.length) while (body.at(-1) === "") body.pop(); // unclosed: still streaming
      out.append(codeBlock(m[2], body.join("\n"), onCopy));
      i += 1; // past the closing fence
    } else if ((m = HEADING.exec(line))) {
      flush();
      out.append(el(`h${Math.min(m[1].length + 2, 6)}`, null, inline(m[2])));
      i += 1;
    } else if (RULE.test(line)) {
      flush();
      out.append(el("hr"));
      i += 1;
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      flush();
      const ordered = !BULLET.test(line);
      const pattern = ordered ? NUMBERED : BULLET;
      const start = ordered ? Number(NUMBERED.exec(line)[1]) : 1;
      const items = [];
      for (; i < src.length && (m = pattern.exec(src[i])); i += 1) items.push(m[m.length - 1]);
      out.append(list(items, ordered, start));
    } else if (QUOTE.test(line)) {
      flush();
      const quoted = [];
      for (; i < src.length && (m = QUOTE.exec(src[i])); i += 1) quoted.push(m[1]);
      out.append(el("blockquote", null, lines(quoted)));
    } else if (line.trim() === "") {
      flush();
      i += 1;
    } else {
      paragraph.push(line);
      i += 1;
    }
  }
  flush();
  return out;
}
