// A promise client of the daemon's Unix sockets (docs/clients.md): newline-delimited
// JSON-RPC 2.0 (docs/protocol.md §1), many calls in flight on one connection, replies
// matched by id, `proc.subscribe` as an async iterator of its notifications.

import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";

import { ConnectionLost, Refusal, RpcError, type ErrorObject } from "./errors.js";
import {
  bindApi,
  MethodNotFoundError,
  REFUSAL_CLASSES,
  RequestTooDeepError,
  RequestTooLargeError,
  type Api,
  type CallOptions,
  type MethodName,
  type Notifications,
  type OutputNotice,
  type ParamsOf,
  type ResultOf,
  type SubscribeParams,
  type SubscribeResult,
} from "./generated.js";

/** The daemon's default `max_request_bytes`: requests are checked against it before sending. */
export const DEFAULT_MAX_REQUEST_BYTES = 1 << 20;
/** The daemon refuses a line nested deeper than this (the envelope is level 1). */
export const MAX_REQUEST_DEPTH = 64;
/** Notifications one subscription holds for a reader that does not keep up. */
export const DEFAULT_MAX_QUEUED = 10000;

/** A server notification, as `proc.subscribe`'s iterator yields it. */
export type Notification = {
  [M in keyof Notifications]: { readonly method: M; readonly params: Notifications[M] };
}[keyof Notifications];

export interface ConnectOptions {
  /** The socket's path; default `<stateDir>/substrate.sock` (or `operator.sock`). */
  readonly path?: string;
  /** The daemon's state dir; default `defaultStateDir()`. */
  readonly stateDir?: string;
  /** Connect to the operator socket (operator-only methods; mode 0600). */
  readonly operator?: boolean;
  /** The daemon's line limit: a longer request is refused here, unsent. null: no check. */
  readonly maxRequestBytes?: number | null;
  /** Notifications a subscription queues before it drops `proc.output` pieces. */
  readonly maxQueued?: number;
}

/** `$SUBSTRATE_STATE_DIR`, else `$XDG_STATE_HOME/substrate`, else `~/.local/state/substrate`. */
export function defaultStateDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env["SUBSTRATE_STATE_DIR"]) return path.resolve(env["SUBSTRATE_STATE_DIR"]);
  const base = env["XDG_STATE_HOME"] || path.join(os.homedir(), ".local", "state");
  return path.resolve(base, "substrate");
}

/** The socket `connect` opens for these options. */
export function socketPath(options: ConnectOptions = {}): string {
  if (options.path) return options.path;
  const dir = options.stateDir ? path.resolve(options.stateDir) : defaultStateDir();
  return path.join(dir, options.operator ? "operator.sock" : "substrate.sock");
}

/** Connect to a daemon socket; rejects with the socket's error when nothing listens. */
export async function connect(options: ConnectOptions = {}): Promise<Client> {
  const socket = net.createConnection({ path: socketPath(options) });
  await new Promise<void>((resolve, reject) => {
    socket.once("connect", () => {
      socket.off("error", reject);
      resolve();
    });
    socket.once("error", reject);
  });
  return new Client(socket, options);
}

/** The error a reply's `error` member stands for: a refusal's own class where one is named. */
export function errorOf(error: ErrorObject): RpcError {
  const refusal = error.data?.["refusal"];
  if (typeof refusal === "string") {
    const cls = REFUSAL_CLASSES[refusal];
    return cls ? new cls(error) : new Refusal(error);
  }
  if (error.code === MethodNotFoundError.code) return new MethodNotFoundError(error);
  return new RpcError(error);
}

interface Waiter {
  resolve(value: unknown): void;
  reject(reason: unknown): void;
}

// Every method is also a member of the client, by its dotted name (`client.fs.read`).
export interface Client extends Api {}

/**
 * One connection to the daemon. Calls may overlap; each resolves with its result or
 * rejects with the refusal's class (`StaleBaseError`, ...), `RpcError` for other
 * errors, or `ConnectionLost`.
 */
export class Client {
  private readonly socket: net.Socket;
  private readonly maxRequestBytes: number | null;
  private readonly maxQueued: number;
  private readonly waiting = new Map<number, Waiter>();
  private readonly subscriptions = new Map<string, Subscription>();
  private nextId = 1;
  private chunks: Buffer[] = [];
  private closedWith: Error | null = null;
  private connectionError: ErrorObject | null = null;
  private readonly closed: Promise<void>;

  constructor(socket: net.Socket, options: ConnectOptions = {}) {
    this.socket = socket;
    this.maxRequestBytes =
      options.maxRequestBytes === undefined ? DEFAULT_MAX_REQUEST_BYTES : options.maxRequestBytes;
    this.maxQueued = options.maxQueued ?? DEFAULT_MAX_QUEUED;
    Object.assign(this, bindApi((method, params, opts) => this.call(method, params, opts)));
    socket.on("data", (chunk: Buffer) => this.received(chunk));
    socket.on("error", () => {}); // reported through "close"
    this.closed = new Promise((resolve) => {
      socket.once("close", () => {
        this.ended();
        resolve();
      });
    });
  }

  /** Call `method` with `params` (by name); the result, typed from the method table. */
  call<M extends MethodName>(
    method: M,
    params?: ParamsOf<M>,
    options: CallOptions = {},
  ): Promise<ResultOf<M>> {
    if (this.closedWith) return Promise.reject(this.closedWith);
    const id = this.nextId++;
    let line: string;
    try {
      line = this.encode(id, method, params ?? {});
    } catch (error) {
      return Promise.reject(error);
    }
    const { signal } = options;
    if (signal?.aborted) return Promise.reject(signal.reason);
    return new Promise<ResultOf<M>>((resolve, reject) => {
      const onAbort = (): void => {
        this.waiting.delete(id);
        reject(signal?.reason);
      };
      this.waiting.set(id, {
        resolve: (value) => {
          signal?.removeEventListener("abort", onAbort);
          resolve(value as ResultOf<M>);
        },
        reject: (reason) => {
          signal?.removeEventListener("abort", onAbort);
          reject(reason);
        },
      });
      signal?.addEventListener("abort", onAbort, { once: true });
      this.socket.write(line);
    });
  }

  /**
   * Subscribe to a process's output: an async iterator of `proc.output` notifications
   * from byte `since` of each stream, ending after the one `proc.exit`. The
   * `proc.subscribe` call goes out at once; its refusal (`ProcessUnknownError`) is thrown
   * by the iteration (and by `ready`). One subscription per process per connection.
   */
  subscribe(proc: string, options: Omit<SubscribeParams, "proc"> = {}): Subscription {
    if (this.subscriptions.has(proc)) {
      throw new Error(`already subscribed to ${proc} on this connection`);
    }
    const subscription = new Subscription(this.maxQueued, () => this.subscriptions.delete(proc));
    this.subscriptions.set(proc, subscription);
    subscription.start(this.call("proc.subscribe", { ...options, proc }));
    return subscription;
  }

  /** Close the connection; calls still waiting reject with `ConnectionLost`. */
  async close(): Promise<void> {
    this.socket.end();
    this.socket.destroySoon();
    await this.closed;
  }

  private encode(id: number, method: string, params: unknown): string {
    const line = JSON.stringify({ jsonrpc: "2.0", id, method, params }) + "\n";
    const size = Buffer.byteLength(line) - 1;
    if (this.maxRequestBytes !== null && size > this.maxRequestBytes) {
      throw new RequestTooLargeError({
        code: RequestTooLargeError.code,
        message: `request line of ${size} bytes exceeds the ${this.maxRequestBytes} byte limit (not sent)`,
        data: { refusal: RequestTooLargeError.refusal, limit: this.maxRequestBytes },
      });
    }
    if (depth(params) + 1 > MAX_REQUEST_DEPTH) {
      throw new RequestTooDeepError({
        code: RequestTooDeepError.code,
        message: `request nests deeper than ${MAX_REQUEST_DEPTH} levels (not sent)`,
        data: { refusal: RequestTooDeepError.refusal, limit: MAX_REQUEST_DEPTH },
      });
    }
    return line;
  }

  private received(chunk: Buffer): void {
    let start = 0;
    let newline = chunk.indexOf(10);
    while (newline !== -1) {
      this.chunks.push(chunk.subarray(start, newline));
      const line = Buffer.concat(this.chunks).toString("utf8").trim();
      this.chunks = [];
      if (line) this.message(JSON.parse(line) as Record<string, unknown>);
      start = newline + 1;
      newline = chunk.indexOf(10, start);
    }
    if (start < chunk.length) this.chunks.push(chunk.subarray(start));
  }

  private message(message: Record<string, unknown>): void {
    if (!("id" in message)) {
      const method = message["method"];
      const params = message["params"] as { proc?: unknown } | undefined;
      const proc = typeof params?.proc === "string" ? params.proc : undefined;
      if ((method === "proc.output" || method === "proc.exit") && proc !== undefined) {
        this.subscriptions.get(proc)?.deliver(message as unknown as Notification);
      }
      return;
    }
    const error = message["error"] as ErrorObject | undefined;
    if (message["id"] === null && error) {
      // About the connection or a line the daemon could not read (docs/protocol.md §1).
      this.connectionError = error;
      return;
    }
    const waiter = this.waiting.get(message["id"] as number);
    if (!waiter) return; // an aborted call's reply
    this.waiting.delete(message["id"] as number);
    if (error) waiter.reject(errorOf(error));
    else waiter.resolve(message["result"]);
  }

  private ended(): void {
    this.closedWith = this.connectionError
      ? errorOf(this.connectionError)
      : new ConnectionLost("connection closed by the daemon");
    for (const waiter of this.waiting.values()) waiter.reject(this.closedWith);
    this.waiting.clear();
    for (const subscription of this.subscriptions.values()) subscription.fail(this.closedWith);
    this.subscriptions.clear();
  }
}

/**
 * The notifications of one `proc.subscribe`, in order. When more than `maxQueued` wait
 * unread, `proc.output` pieces are dropped (never `proc.exit`): the next piece of that
 * stream delivered carries `skipped_from` (bytes [skipped_from, offset) were not
 * delivered: subscribe again with `since`, or read the artifact), and an empty piece
 * with `skipped_from` precedes the `proc.exit` of a stream whose last pieces were dropped.
 */
export class Subscription implements AsyncIterableIterator<Notification> {
  /** The `proc.subscribe` reply; rejects with its refusal. */
  ready: Promise<SubscribeResult> = Promise.resolve({ proc: "", subscribed: false });
  /** `proc.output` pieces dropped because the queue was full (0: none lost). */
  dropped = 0;
  private readonly queue: Notification[] = [];
  private readonly holes = new Map<string, [number, number]>();
  private wake: (() => void) | null = null;
  private error: unknown = null;
  private done = false;

  constructor(
    private readonly maxQueued: number,
    private readonly forget: () => void,
  ) {}

  /** @internal Called by the client with its `proc.subscribe` call. */
  start(reply: Promise<SubscribeResult>): void {
    this.ready = reply;
    reply.catch((error: unknown) => this.fail(error));
  }

  /** @internal A notification for this process. */
  deliver(notification: Notification): void {
    if (this.done) return;
    if (notification.method === "proc.exit") {
      for (const [stream, [first, end]] of this.holes) {
        const params: OutputNotice = {
          proc: notification.params.proc,
          stream: stream as OutputNotice["stream"],
          offset: end,
          data: "",
          skipped_from: first,
        };
        this.queue.push({ method: "proc.output", params });
      }
      this.holes.clear();
      this.queue.push(notification);
      this.done = true;
      this.forget();
    } else if (this.queue.length < this.maxQueued) {
      this.queue.push(this.withHole(notification.params));
    } else {
      this.recordHole(notification.params);
    }
    this.wake?.();
  }

  /** @internal The connection ended (or the subscription was refused). */
  fail(error: unknown): void {
    if (this.done) return;
    this.error = error;
    this.done = true;
    this.forget();
    this.wake?.();
  }

  async next(): Promise<IteratorResult<Notification>> {
    for (;;) {
      const item = this.queue.shift();
      if (item) return { value: item, done: false };
      if (this.error !== null) {
        const error = this.error;
        this.error = null;
        throw error;
      }
      if (this.done) return { value: undefined, done: true };
      await new Promise<void>((resolve) => (this.wake = resolve));
      this.wake = null;
    }
  }

  /** Stop iterating: what the daemon still sends for this process is dropped here. */
  async return(): Promise<IteratorResult<Notification>> {
    this.queue.length = 0;
    if (!this.done) {
      this.done = true;
      this.forget();
    }
    return { value: undefined, done: true };
  }

  [Symbol.asyncIterator](): AsyncIterableIterator<Notification> {
    return this;
  }

  private withHole(params: OutputNotice): Notification {
    const hole = this.holes.get(params.stream);
    if (!hole) return { method: "proc.output", params };
    this.holes.delete(params.stream);
    const skipped = params.skipped_from ?? hole[0];
    return { method: "proc.output", params: { ...params, skipped_from: Math.min(skipped, hole[0]) } };
  }

  private recordHole(params: OutputNotice): void {
    this.dropped += 1;
    const length =
      params.data != null
        ? Buffer.byteLength(params.data)
        : params.data_b64 != null
          ? Buffer.from(params.data_b64, "base64").length
          : 0;
    const end = params.offset + length;
    const hole = this.holes.get(params.stream);
    const start = Math.min(params.skipped_from ?? params.offset, hole ? hole[0] : Infinity);
    this.holes.set(params.stream, [start, Math.max(end, hole ? hole[1] : end)]);
  }
}

/** How deeply `value` nests arrays and objects (a scalar is 0). */
function depth(value: unknown): number {
  // Iterative, so a cyclic or absurdly deep value cannot overflow the stack here;
  // JSON.stringify has already refused a cycle.
  let deepest = 0;
  const stack: [unknown, number][] = [[value, 0]];
  while (stack.length) {
    const [item, level] = stack.pop() as [unknown, number];
    if (item === null || typeof item !== "object") continue;
    deepest = Math.max(deepest, level + 1);
    if (deepest > MAX_REQUEST_DEPTH) return deepest;
    for (const child of Object.values(item)) stack.push([child, level + 1]);
  }
  return deepest;
}
