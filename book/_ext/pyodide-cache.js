// The calculators' service worker: each of Pyodide's files (about 12 MB in all), once fetched
// from this site, is kept in the browser's Cache Storage and answered from there on every later
// page, whatever caching headers the host sends. Only GET requests for this site's
// _static/pyodide/ are touched. book/_ext/calculators.py writes it at the site's root (a worker
// controls only the pages under its own folder), the cache named after the Pyodide it ships.
const CACHE = "offloadlab-pyodide-@VERSION@";

self.addEventListener("install", () => self.skipWaiting());

self.addEventListener("activate", (event) => {
  event.waitUntil((async () => {
    for (const name of await caches.keys()) {
      if (name.startsWith("offloadlab-pyodide-") && name !== CACHE) await caches.delete(name);
    }
    await self.clients.claim();  // the page that registered it, too
  })());
});

self.addEventListener("fetch", (event) => {
  const url = new URL(event.request.url);
  const ours = url.origin === self.location.origin
    && url.pathname.startsWith(new URL("_static/pyodide/", self.registration.scope).pathname);
  if (event.request.method !== "GET" || !ours) return;
  event.respondWith((async () => {
    const cache = await caches.open(CACHE);
    const kept = await cache.match(event.request);
    if (kept) return kept;
    const response = await fetch(event.request);
    if (response.ok) await cache.put(event.request, response.clone());
    return response;
  })());
});
