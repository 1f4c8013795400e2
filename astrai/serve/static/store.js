// What the page keeps in this browser's localStorage: the chats, the settings, the API key.
// Nothing of it is sent anywhere except, per request, to this same server.

const CHATS = "astrai.chats";
const CURRENT = "astrai.current";
const SETTINGS = "astrai.settings";
const API_KEY = "astrai.apiKey";

export const DEFAULT_SETTINGS = { system: "", temperature: 0.7, top_p: 1, max_tokens: "" };

function read(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback; // storage disabled, or a value this page did not write
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // full or disabled: the page still works, it only forgets on reload
  }
}

/** A chat: { id, title, updated, messages: [{ role, content, stats? }] }. */
export function newChat() {
  const id = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
  return { id, title: "", updated: Date.now(), messages: [] };
}

export function loadChats() {
  const chats = read(CHATS, []);
  return Array.isArray(chats) ? chats.filter((c) => c && Array.isArray(c.messages)) : [];
}

export function saveChats(chats) {
  write(CHATS, chats.filter((c) => c.messages.length > 0)); // an empty chat is not worth keeping
}

export const loadCurrent = () => read(CURRENT, null);
export const saveCurrent = (id) => write(CURRENT, id);
export const loadSettings = () => ({ ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) });
export const saveSettings = (settings) => write(SETTINGS, settings);
export const loadApiKey = () => read(API_KEY, "");
export const saveApiKey = (key) => write(API_KEY, key);
