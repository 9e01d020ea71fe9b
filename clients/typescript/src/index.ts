// substrate's TypeScript client (docs/clients.md).
export * from "./client.js";
export * from "./errors.js";
export * from "./generated.js";
