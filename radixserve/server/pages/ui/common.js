// Shared by both pages: the API key field and calls to the server's JSON routes.
"use strict";

const KEY_STORE = "radixserve.apiKey";

// The key lives in this tab's sessionStorage only; the pages themselves need none.
function setUpKeyField() {
  const field = document.getElementById("api-key");
  field.value = sessionStorage.getItem(KEY_STORE) || "";
  field.addEventListener("change", () => sessionStorage.setItem(KEY_STORE, field.value.trim()));
}

function authHeaders() {
  const key = document.getElementById("api-key").value.trim();
  const headers = { "Content-Type": "application/json" };
  if (key) headers.Authorization = "Bearer " + key;
  return headers;
}

// An OpenAI-style error body becomes an Error with its message.
async function apiError(response) {
  let message = response.status + " " + response.statusText;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch (e) { /* not JSON */ }
  return new Error(message);
}

async function getJson(path) {
  const response = await fetch(path, { headers: authHeaders() });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

async function postJson(path, body, signal) {
  const response = await fetch(path, {
    method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw await apiError(response);
  return response;
}

// Another method (DELETE): the parsed JSON answer, or an Error with the server's message.
async function callJson(method, path) {
  const response = await fetch(path, { method, headers: authHeaders() });
  if (!response.ok) throw await apiError(response);
  return response.json();
}

// Make an element: el("span", {class: "x"}, "text", child, ...).
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  for (const child of children) node.append(child);
  return node;
}
