// bench/fanout.py's viewers in Node.js (``--client-runtime node``): the same protocol as its Python client,
// at a fraction of its CPU per delivery, so the load generator adds less of its own queueing to what it
// measures. Plain TCP sockets with a minimal WebSocket frame reader or SSE reader; no npm packages.
//
//     node bench/fanout_client.mjs <ws|sse> <port> <viewers>
//
// Prints "ready" once every viewer is attached, then, when stdin closes, one JSON line:
// {"latencies": [seconds...], "received": [deltas per viewer that stayed attached], "detached": n}.
import net from "node:net";
import crypto from "node:crypto";
import { performance } from "node:perf_hooks";

const [kind, portText, viewersText] = process.argv.slice(2);
const port = Number(portText);
const viewers = Number(viewersText);
const HOST = "127.0.0.1";
const CONVERSATION = "bench";
const ATTACH = Buffer.from('{"request_id":"a","operation":"attach","conversation_id":"bench","access":"observe"}');
const DELTA = Buffer.from('"type":"assistant-delta"');
const EMITTED = Buffer.from('"emitted_at":"');
const TYPE = Buffer.from('"type":"');

const now = () => (performance.timeOrigin + performance.now()) / 1000; // seconds, wall clock

function masked(payload) {
  const mask = crypto.randomBytes(4);
  const out = Buffer.alloc(6 + payload.length);
  out[0] = 0x81;
  out[1] = 0x80 | payload.length;
  mask.copy(out, 2);
  for (let i = 0; i < payload.length; i++) out[6 + i] = payload[i] ^ mask[i % 4];
  return out;
}

// "2026-12-02T10:00:00.123456Z" (or with an offset) as seconds, microseconds kept
function seconds(text) {
  const match = /^(.*T\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$/.exec(text);
  if (!match) return NaN;
  return Date.parse(match[1] + match[3]) / 1000 + (match[2] ? Number(match[2]) : 0);
}

class Viewer {
  constructor(onReady) {
    this.onReady = onReady;
    this.buffer = Buffer.alloc(0);
    this.handshaken = false;
    this.ready = false;
    this.detached = false;
    this.seen = [];
  }

  data(chunk, at) {
    this.buffer = this.buffer.length ? Buffer.concat([this.buffer, chunk]) : chunk;
    if (!this.handshaken) {
      const end = this.buffer.indexOf("\r\n\r\n");
      if (end < 0) return;
      this.buffer = this.buffer.subarray(end + 4);
      this.handshaken = true;
      if (kind === "ws") this.socket.write(masked(ATTACH));
    }
    if (kind === "ws") this.frames(at);
    else this.events(at);
  }

  frames(at) {
    let buffer = this.buffer;
    while (buffer.length >= 2) {
      const opcode = buffer[0] & 0x0f;
      let length = buffer[1] & 0x7f;
      let offset = 2;
      if (length === 126) {
        if (buffer.length < 4) break;
        length = buffer.readUInt16BE(2);
        offset = 4;
      } else if (length === 127) {
        if (buffer.length < 10) break;
        length = Number(buffer.readBigUInt64BE(2));
        offset = 10;
      }
      if (buffer.length < offset + length) break;
      const payload = buffer.subarray(offset, offset + length);
      buffer = buffer.subarray(offset + length);
      if (opcode === 0x8) {
        this.detached = true;
        continue;
      }
      this.payload(payload, at);
    }
    this.buffer = buffer.length ? Buffer.from(buffer) : Buffer.alloc(0);
  }

  events(at) {
    const end = this.buffer.lastIndexOf("\n\n");
    if (end < 0) return;
    this.payload(Buffer.from(this.buffer.subarray(0, end + 2)), at);
    this.buffer = Buffer.from(this.buffer.subarray(end + 2));
  }

  payload(payload, at) {
    if (!this.ready && (payload.includes('"outcome":"ok"') || payload.includes("event: snapshot"))) {
      this.ready = true;
      this.onReady();
    }
    if (payload.includes("resync-required")) this.detached = true;
    if (payload.includes(DELTA)) this.seen.push([at, Buffer.from(payload)]); // parsed after the run
  }

  latencies() {
    const out = [];
    for (const [at, payload] of this.seen) {
      let start = payload.indexOf(EMITTED);
      while (start >= 0) {
        start += EMITTED.length;
        const end = payload.indexOf('"', start);
        const type = payload.indexOf(TYPE, end);
        if (type >= 0 && payload.subarray(type, type + DELTA.length).equals(DELTA)) {
          out.push(at - seconds(payload.toString("latin1", start, end)));
        }
        start = payload.indexOf(EMITTED, end);
      }
    }
    return out;
  }
}

function connect() {
  return new Promise((resolve, reject) => {
    const viewer = new Viewer(() => resolve(viewer));
    const socket = net.connect(port, HOST);
    viewer.socket = socket;
    socket.setNoDelay(true);
    socket.on("data", (chunk) => viewer.data(chunk, now()));
    socket.on("close", () => {
      viewer.detached = true;
      if (!viewer.ready) reject(new Error("closed before attaching"));
    });
    socket.on("error", (error) => {
      if (!viewer.ready) reject(error);
    });
    socket.on("connect", () => {
      const key = crypto.randomBytes(16).toString("base64");
      socket.write(
        kind === "ws"
          ? `GET /control HTTP/1.1\r\nHost: ${HOST}:${port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n` +
              `Sec-WebSocket-Key: ${key}\r\nSec-WebSocket-Version: 13\r\n\r\n`
          : `GET /conversations/${CONVERSATION}/events HTTP/1.1\r\nHost: ${HOST}:${port}\r\n` +
              "Accept: text/event-stream\r\n\r\n",
      );
    });
  });
}

const all = [];
// attach in batches of 16: the control server reads at most 32 snapshots at once
for (let batch = 0; batch < viewers; batch += 16) {
  const pending = [];
  for (let i = 0; i < Math.min(16, viewers - batch); i++) pending.push(connect());
  all.push(...(await Promise.all(pending)));
}
process.stdout.write("ready\n");

process.stdin.resume();
process.stdin.on("end", () => {
  const latencies = [];
  const received = [];
  let detached = 0;
  for (const viewer of all) {
    const own = viewer.latencies();
    latencies.push(...own);
    if (viewer.detached) detached += 1;
    else received.push(own.length);
  }
  for (const viewer of all) viewer.socket.destroy();
  process.stdout.write(JSON.stringify({ latencies, received, detached }) + "\n");
});
