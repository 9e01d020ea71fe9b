// The client against a real daemon (started here; docs/clients.md "Tests").

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Client,
  ConnectionLost,
  connect,
  GENERATED_FROM_VERSION,
  InvalidParamsError,
  METHODS,
  MethodNotFoundError,
  ProcessUnknownError,
  Refusal,
  REFUSAL_CLASSES,
  RequestTooLargeError,
  RpcError,
  StaleBaseError,
  UnauthorizedError,
  UnknownWorkspaceError,
  type MethodName,
  type Notification,
} from "../src/index.js";
import { Daemon } from "./daemon.js";

let daemon: Daemon;
let client: Client;

before(async () => {
  daemon = await new Daemon().start();
  client = await connect({ stateDir: daemon.stateDir });
});

after(async () => {
  await client?.close();
  await daemon?.stop();
});

interface DiscoveredMethod {
  name: string;
  params: { name: string; required: boolean }[];
  "x-substrate-sockets": string[];
  "x-substrate-notifications"?: { name: string }[];
}

describe("the generated table is the daemon's rpc.discover", () => {
  test("same methods, params, sockets and refusals", async () => {
    const doc = (await client.rpc.discover()) as unknown as {
      info: { version: string };
      methods: DiscoveredMethod[];
      components: { errors: Record<string, { data?: { refusal?: string } }> };
    };
    assert.equal(doc.info.version, GENERATED_FROM_VERSION);
    assert.deepEqual(doc.methods.map((m) => m.name).sort(), Object.keys(METHODS).sort());
    for (const m of doc.methods) {
      const info = METHODS[m.name as MethodName];
      assert.deepEqual(info.sockets, m["x-substrate-sockets"], m.name);
      assert.equal(info.paramsRequired, m.params.some((p) => p.required), m.name);
      assert.deepEqual(info.notifications, (m["x-substrate-notifications"] ?? []).map((n) => n.name));
    }
    const refusals = Object.values(doc.components.errors).flatMap((e) => (e.data?.refusal ? [e.data.refusal] : []));
    assert.deepEqual(refusals.sort(), Object.keys(REFUSAL_CLASSES).sort());
    for (const [name, cls] of Object.entries(REFUSAL_CLASSES)) assert.equal(cls.refusal, name);
  });
});

describe("calls", () => {
  test("adopt, read, guarded write, read back", async () => {
    const root = daemon.makeWorkspace({ "README.md": "# demo\n" });
    const { workspace } = await client.workspace.adopt({ path: root });
    const read = await client.fs.read({ workspace, path: "README.md" });
    assert.equal(read.data, "# demo\n");
    assert.equal(read.encoding, "utf-8");
    const plan = await client.fs.write({ workspace, path: "README.md", base_sha256: read.sha256, content: "# new\n" });
    assert.equal(plan.applied, true);
    assert.equal(plan.op, "replace");
    assert.equal((await client.call("fs.read", { workspace, path: "README.md" })).data, "# new\n");
  });

  test("many calls in flight on one connection, matched by id", async () => {
    const files = Object.fromEntries(Array.from({ length: 20 }, (_, i) => [`f${i}.txt`, `file ${i}\n`]));
    const { workspace } = await client.workspace.adopt({ path: daemon.makeWorkspace(files) });
    const reads = await Promise.all(Object.keys(files).map((p) => client.fs.read({ workspace, path: p })));
    assert.deepEqual(reads.map((r) => r.data), Object.values(files));
  });
});

describe("refusals are typed errors", () => {
  test("stale_base carries current_sha256 and changes nothing", async () => {
    const { workspace } = await client.workspace.adopt({ path: daemon.makeWorkspace({ "a.txt": "one\n" }) });
    const read = await client.fs.read({ workspace, path: "a.txt" });
    const stale = "0".repeat(64);
    await assert.rejects(client.fs.write({ workspace, path: "a.txt", base_sha256: stale, content: "two\n" }), (error) => {
      assert.ok(error instanceof StaleBaseError);
      assert.ok(error instanceof Refusal);
      assert.ok(error instanceof RpcError);
      assert.equal(error.refusal, "stale_base");
      assert.equal(error.code, -32001);
      assert.equal(error.data["current_sha256"], read.sha256);
      return true;
    });
    assert.equal((await client.fs.read({ workspace, path: "a.txt" })).data, "one\n");
  });

  test("unknown_workspace, invalid_params with its path, unauthorized, unknown method", async () => {
    await assert.rejects(client.fs.read({ workspace: "nope", path: "a" }), UnknownWorkspaceError);
    await assert.rejects(
      client.call("fs.read", { workspace: "w", path: "a", offset: -1 }),
      (error) => error instanceof InvalidParamsError && error.code === -32602 && error.data["path"] === "$.offset",
    );
    await assert.rejects(client.grant.list(), UnauthorizedError);
    await assert.rejects(
      client.call("fs.reed" as MethodName),
      (error) => error instanceof MethodNotFoundError && (error.data["suggestions"] as string[]).includes("fs.read"),
    );
  });

  test("the operator socket answers operator-only methods", async () => {
    const operator = await connect({ stateDir: daemon.stateDir, operator: true });
    try {
      const grants = await operator.grant.list();
      assert.ok(Array.isArray(grants.grants));
    } finally {
      await operator.close();
    }
  });

  test("a request over the line limit is refused here, unsent, and the connection stays", async () => {
    const { workspace } = await client.workspace.adopt({ path: daemon.makeWorkspace() });
    const content = "x".repeat((1 << 20) + 1);
    await assert.rejects(
      client.fs.write({ workspace, path: "big.txt", base_sha256: null, content }),
      (error) => error instanceof RequestTooLargeError && error.data["limit"] === 1 << 20,
    );
    assert.equal((await client.daemon.status()).version, GENERATED_FROM_VERSION);
  });

  test("a closed connection rejects with ConnectionLost", async () => {
    const other = await connect({ stateDir: daemon.stateDir });
    await other.close();
    await assert.rejects(other.daemon.status(), ConnectionLost);
  });
});

describe("proc.subscribe is an async iterator", () => {
  test("a command's output, in order, then its exit", async () => {
    const { workspace } = await client.workspace.adopt({ path: daemon.makeWorkspace() });
    const argv = ["sh", "-c", "for i in 1 2 3; do echo line $i; done; echo oops >&2; exit 3"];
    const { proc } = await client.proc.start({ workspace, profile: "default", argv });
    const out: Record<string, string> = { stdout: "", stderr: "" };
    let exit: Notification | undefined;
    for await (const event of client.subscribe(proc)) {
      if (event.method === "proc.output") {
        assert.equal(event.params.offset, Buffer.byteLength(out[event.params.stream] ?? ""));
        out[event.params.stream] += event.params.data ?? "";
      } else {
        exit = event;
      }
    }
    assert.deepEqual(out, { stdout: "line 1\nline 2\nline 3\n", stderr: "oops\n" });
    assert.ok(exit?.method === "proc.exit");
    assert.equal(exit.params.exit_code, 3);
    // Subscribing to a finished process replays what was kept, from `since`.
    const replay: string[] = [];
    for await (const event of client.subscribe(proc, { since: 7 })) {
      if (event.method === "proc.output" && event.params.stream === "stdout") replay.push(event.params.data ?? "");
    }
    assert.equal(replay.join(""), "line 2\nline 3\n");
  });

  test("an unknown process is thrown by the iteration", async () => {
    const iterate = async (): Promise<void> => {
      for await (const _ of client.subscribe("p-unknown")) assert.fail("nothing to iterate");
    };
    await assert.rejects(iterate(), ProcessUnknownError);
  });
});
