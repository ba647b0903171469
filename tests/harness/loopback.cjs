// Preload for Node servers under test: `node -r tests/harness/loopback.cjs server.js`.
// Some peers (server-everything calls app.listen(PORT)) bind every interface; this makes
// any listen() that names a port but no host bind 127.0.0.1 instead, so test servers are
// reachable from this machine only.
"use strict";
const net = require("net");
const originalListen = net.Server.prototype.listen;

net.Server.prototype.listen = function listenOnLoopback(...args) {
  const first = args[0];
  if (typeof first === "number" || (typeof first === "string" && /^\d+$/.test(first))) {
    // listen(port[, host][, backlog][, callback]): insert the host when it is missing.
    if (typeof args[1] !== "string") {
      args.splice(1, 0, "127.0.0.1");
    }
  } else if (first && typeof first === "object" && !Array.isArray(first) && first.port !== undefined && !first.host && !first.path) {
    args[0] = { ...first, host: "127.0.0.1" };
  } else if (first === undefined || typeof first === "function") {
    // listen() / listen(callback): an ephemeral port, on loopback.
    args.unshift(0, "127.0.0.1");
  }
  return originalListen.apply(this, args);
};
