// Conversations and settings in the browser's localStorage; nothing is kept on the server.
//
// A conversation: {id, title, created, updated, messages: [{role, content, reasoning?, stats?}]}.
// All conversations live under one key, written whole: they are small text and this keeps a
// reload consistent (a half-written list cannot exist).

const CONVERSATIONS = "mlxcel.conversations.v1";
const SETTINGS = "mlxcel.settings.v1";
const API_KEY = "mlxcel.apiKey";

function readJson(key, fallback) {
  try {
    const text = localStorage.getItem(key);
    return text ? JSON.parse(text) : fallback;
  } catch {
    return fallback;
  }
}

function all() {
  const list = readJson(CONVERSATIONS, []);
  return Array.isArray(list) ? list : [];
}

function writeAll(list) {
  localStorage.setItem(CONVERSATIONS, JSON.stringify(list));
}

export function listConversations() {
  return all().sort((a, b) => b.updated - a.updated);
}

export function getConversation(id) {
  return all().find((c) => c.id === id) || null;
}

export function newConversation() {
  const now = Date.now();
  const id = crypto.randomUUID ? crypto.randomUUID() : `${now}-${Math.random().toString(16).slice(2)}`;
  return { id, title: "New chat", created: now, updated: now, messages: [] };
}

export function saveConversation(conversation) {
  conversation.updated = Date.now();
  writeAll([...all().filter((c) => c.id !== conversation.id), conversation]);
}

export function renameConversation(id, title) {
  const c = getConversation(id);
  if (c) {
    c.title = title;
    saveConversation(c);
  }
}

export function deleteConversation(id) {
  writeAll(all().filter((c) => c.id !== id));
}

export function exportJson() {
  return JSON.stringify({ exported: new Date().toISOString(), conversations: listConversations() }, null, 2);
}

export const loadSettings = () => readJson(SETTINGS, {});
export const saveSettings = (values) => localStorage.setItem(SETTINGS, JSON.stringify(values));
export const loadApiKey = () => localStorage.getItem(API_KEY) || "";
export const saveApiKey = (key) => localStorage.setItem(API_KEY, key);
