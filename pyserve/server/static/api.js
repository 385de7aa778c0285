// The pages' calls to the server's API: the API key the user typed (kept in localStorage,
// sent as `Authorization: Bearer <key>`) and the server's error objects turned into messages.

const KEY_ITEM = "pyserve.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

export function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// An answer other than 2xx: its status and the message of its error object.
export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// fetch(path) with the key; a JSON body is sent as JSON. Resolves to the Response when it is
// 2xx, else rejects with an ApiError (an AbortError when `signal` aborts).
export async function apiFetch(path, { method = "GET", body, signal } = {}) {
  const headers = authHeaders();
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal,
  });
  if (!res.ok) throw new ApiError(res.status, await errorMessage(res));
  return res;
}

export async function getJSON(path) {
  return (await apiFetch(path)).json();
}

async function errorMessage(res) {
  const text = await res.text();
  try {
    const error = JSON.parse(text).error;
    if (error && error.message) return error.message;
  } catch (_) {
    // not JSON: the text itself
  }
  return text || res.statusText;
}

// What to tell the user about a failed call.
export function describeError(err) {
  if (err instanceof ApiError) {
    if (err.status === 401) return "401: this server needs an API key: type it in the API key field and save it.";
    return `${err.status}: ${err.message}`;
  }
  return String(err.message || err);
}
