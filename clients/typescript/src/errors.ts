// Errors of the client (docs/clients.md "Errors"). The generated refusal classes
// (src/generated.ts) extend `Refusal`, one per name of the daemon's taxonomy.

/** The `error` member of a JSON-RPC error reply (docs/protocol.md §1). */
export interface ErrorObject {
  readonly code: number;
  readonly message: string;
  readonly data?: Record<string, unknown>;
}

/**
 * An error reply from the daemon. `code` is the JSON-RPC code; `data` what the daemon
 * sent with it (`{}` when nothing). Thrown as is for the standard codes without a name
 * of their own (parse error, invalid request).
 */
export class RpcError extends Error {
  override readonly name: string = "RpcError";
  readonly code: number;
  readonly data: Record<string, unknown>;

  constructor(error: ErrorObject) {
    super(error.message);
    this.code = error.code;
    this.data = error.data ?? {};
  }

  /** The named refusal (`data.refusal`), or undefined for plain codes. */
  get refusal(): string | undefined {
    const value = this.data["refusal"];
    return typeof value === "string" ? value : undefined;
  }
}

/**
 * A named refusal (code -32001, or -32602 for `invalid_params`): the daemon said no and
 * changed nothing. Each name has its own subclass (`StaleBaseError` for `stale_base`);
 * a name this client does not know (a newer daemon) is a plain `Refusal`.
 */
export class Refusal extends RpcError {
  override readonly name: string = "Refusal";
}

/** A generated refusal class: constructible from the error object, named by `refusal`. */
export interface RefusalClass {
  new (error: ErrorObject): Refusal;
  readonly refusal: string;
  readonly code: number;
}

/**
 * The connection ended before the reply came: the daemon closed it (a stop, an idle
 * timeout) or the socket failed. The call may or may not have run.
 */
export class ConnectionLost extends Error {
  override readonly name: string = "ConnectionLost";
}
