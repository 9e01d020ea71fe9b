// A real daemon for the tests: `python -m substrate serve` on a private state dir, run
// from the checkout holding this client (so the tests exercise that checkout's daemon).
// `SUBSTRATE_PYTHON` names the interpreter (default `python3`).

import { spawn, type ChildProcess } from "node:child_process";
import * as fs from "node:fs";
import * as net from "node:net";
import * as os from "node:os";
import * as path from "node:path";
import { fileURLToPath } from "node:url";

/** The checkout: dist/test/ → clients/typescript/ → the repository root. */
export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../..");
const READY_TIMEOUT_MS = 30_000;
const STOP_TIMEOUT_MS = 60_000;
/** Workspaces belong to this user, as agents' checkouts do (a root-owned one is refused). */
const WORKSPACE_UID = 1000;

export class Daemon {
  readonly base: string;
  readonly stateDir: string;
  readonly adoptRoot: string;
  private proc: ChildProcess | null = null;
  private names = 0;

  constructor() {
    // Short: a socket path must fit in 108 bytes.
    this.base = fs.mkdtempSync(path.join(os.tmpdir(), "sbst-ts-"));
    this.stateDir = path.join(this.base, "state");
    this.adoptRoot = path.join(this.base, "roots");
    fs.mkdirSync(this.adoptRoot);
  }

  get agentSocket(): string {
    return path.join(this.stateDir, "substrate.sock");
  }

  get operatorSocket(): string {
    return path.join(this.stateDir, "operator.sock");
  }

  async start(): Promise<this> {
    const config = path.join(this.base, "substrate.toml");
    fs.writeFileSync(
      config,
      `state_dir = ${JSON.stringify(this.stateDir)}\n` +
        `adopt_roots = [${JSON.stringify(this.adoptRoot)}]\n` +
        `listen = "127.0.0.1:0"\n`,
    );
    const log = fs.openSync(path.join(this.base, "daemon.log"), "a");
    const env: NodeJS.ProcessEnv = { ...process.env, PYTHONPATH: [REPO_ROOT, process.env["PYTHONPATH"]].filter(Boolean).join(":") };
    delete env["SUBSTRATE_STATE_DIR"];
    const python = process.env["SUBSTRATE_PYTHON"] || "python3";
    const argv = ["-m", "substrate", "--state-dir", this.stateDir, "serve", "--config", config];
    this.proc = spawn(python, argv, { cwd: this.base, env, stdio: ["ignore", log, log] });
    fs.closeSync(log);
    const deadline = Date.now() + READY_TIMEOUT_MS;
    while (!((await accepts(this.agentSocket)) && (await accepts(this.operatorSocket)))) {
      if (this.proc.exitCode !== null || Date.now() > deadline) {
        throw new Error(`daemon not ready (exit ${this.proc.exitCode}):\n${this.log()}`);
      }
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    return this;
  }

  /** A workspace directory under the adopt root (not adopted yet), owned by uid 1000. */
  makeWorkspace(files: Record<string, string> = { "README.md": "# demo\n" }): string {
    const root = path.join(this.adoptRoot, `ws-${++this.names}`);
    fs.mkdirSync(root);
    for (const [rel, content] of Object.entries(files)) {
      fs.mkdirSync(path.dirname(path.join(root, rel)), { recursive: true });
      fs.writeFileSync(path.join(root, rel), content);
    }
    if (process.getuid?.() === 0) chownTree(root);
    return root;
  }

  log(): string {
    try {
      return fs.readFileSync(path.join(this.base, "daemon.log"), "utf8").split("\n").slice(-80).join("\n");
    } catch {
      return "";
    }
  }

  /** SIGTERM (the daemon removes its sandboxes), wait, then remove the temp dir. */
  async stop(): Promise<void> {
    const proc = this.proc;
    if (proc && proc.exitCode === null && proc.signalCode === null) {
      const exited = new Promise<void>((resolve) => proc.once("exit", () => resolve()));
      proc.kill("SIGTERM");
      const timer = setTimeout(() => proc.kill("SIGKILL"), STOP_TIMEOUT_MS);
      await exited;
      clearTimeout(timer);
    }
    fs.rmSync(this.base, { recursive: true, force: true });
  }
}

function chownTree(root: string): void {
  fs.lchownSync(root, WORKSPACE_UID, WORKSPACE_UID);
  for (const entry of fs.readdirSync(root, { withFileTypes: true })) {
    const child = path.join(root, entry.name);
    if (entry.isDirectory()) chownTree(child);
    else fs.lchownSync(child, WORKSPACE_UID, WORKSPACE_UID);
  }
}

function accepts(socketPath: string): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.createConnection({ path: socketPath });
    socket.once("connect", () => {
      socket.destroy();
      resolve(true);
    });
    socket.once("error", () => resolve(false));
  });
}
