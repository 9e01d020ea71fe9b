// The client's own logic without a daemon: a subscription's queue bound and its holes,
// a refused subscription, connecting where nothing listens (docs/clients.md).

import assert from "node:assert/strict";
import * as os from "node:os";
import * as path from "node:path";
import { test } from "node:test";

import { connect, defaultStateDir, socketPath, Subscription, type Notification } from "../src/index.js";

const output = (stream: "stdout" | "stderr", offset: number, data: string): Notification => ({
  method: "proc.output",
  params: { proc: "p_1", stream, offset, data },
});
const exit: Notification = { method: "proc.exit", params: { proc: "p_1", exit_code: 0 } };

async function drain(subscription: Subscription): Promise<Notification[]> {
  const seen: Notification[] = [];
  for await (const event of subscription) seen.push(event);
  return seen;
}

test("a full queue drops output, never the exit, and marks the hole", async () => {
  let forgotten = 0;
  const subscription = new Subscription(2, () => forgotten++);
  subscription.deliver(output("stdout", 0, "aa"));
  subscription.deliver(output("stdout", 2, "bb"));
  subscription.deliver(output("stdout", 4, "cc")); // dropped
  subscription.deliver(output("stderr", 0, "e")); // dropped: its stream's hole closes at the exit
  subscription.deliver(exit);
  assert.equal(subscription.dropped, 2);
  assert.equal(forgotten, 1);
  const seen = await drain(subscription);
  assert.deepEqual(seen, [
    output("stdout", 0, "aa"),
    output("stdout", 2, "bb"),
    { method: "proc.output", params: { proc: "p_1", stream: "stdout", offset: 6, data: "", skipped_from: 4 } },
    { method: "proc.output", params: { proc: "p_1", stream: "stderr", offset: 1, data: "", skipped_from: 0 } },
    exit,
  ]);
});

test("the next piece after a hole carries skipped_from", async () => {
  const subscription = new Subscription(1, () => {});
  subscription.deliver(output("stdout", 0, "a"));
  subscription.deliver(output("stdout", 1, "b")); // dropped
  assert.deepEqual(await subscription.next(), { value: output("stdout", 0, "a"), done: false });
  subscription.deliver(output("stdout", 2, "c"));
  const next = await subscription.next();
  assert.deepEqual(next.value, { method: "proc.output", params: { proc: "p_1", stream: "stdout", offset: 2, data: "c", skipped_from: 1 } });
  subscription.deliver(exit);
  assert.deepEqual(await drain(subscription), [exit]);
});

test("a refused subscription throws from the iteration, once", async () => {
  const subscription = new Subscription(10, () => {});
  const refusal = new Error("refused");
  subscription.start(Promise.reject(refusal));
  await assert.rejects(subscription.next(), refusal);
  assert.deepEqual(await subscription.next(), { value: undefined, done: true });
  await assert.rejects(subscription.ready, refusal);
});

test("leaving the loop early stops delivery", async () => {
  const subscription = new Subscription(10, () => {});
  subscription.deliver(output("stdout", 0, "a"));
  for await (const event of subscription) {
    assert.equal(event.method, "proc.output");
    break;
  }
  subscription.deliver(output("stdout", 1, "b"));
  assert.deepEqual(await subscription.next(), { value: undefined, done: true });
});

test("socket paths follow the state dir, the environment, then XDG", async () => {
  assert.equal(socketPath({ stateDir: "/s" }), "/s/substrate.sock");
  assert.equal(socketPath({ stateDir: "/s", operator: true }), "/s/operator.sock");
  assert.equal(socketPath({ path: "/x.sock" }), "/x.sock");
  assert.equal(defaultStateDir({ SUBSTRATE_STATE_DIR: "/e" }), "/e");
  assert.equal(defaultStateDir({ XDG_STATE_HOME: "/x" }), "/x/substrate");
  assert.equal(defaultStateDir({}), path.join(os.homedir(), ".local", "state", "substrate"));
  await assert.rejects(connect({ stateDir: path.join(os.tmpdir(), "sbst-nothing-here") }), /ENOENT/);
});
