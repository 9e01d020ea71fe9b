// The substrate terminal page: xterm.js on the JSON WebSocket PTY protocol (docs/protocol.md §7).
//
// The token comes from the URL fragment (#token=...&session=...&mode=observe), which
// browsers never send to a server, or from the form; it is removed from the address bar
// at once and sent only in the `open` frame. A dropped connection is resumed with the
// session id and the last output `seq`; `resync` resets the screen.
"use strict";
(() => {
  const MAX_INPUT_CHARS = 8192; // keeps every input frame far below the 64 KiB cap
  const params = new URLSearchParams(location.hash.slice(1));
  if (location.hash) history.replaceState(null, "", location.pathname);

  const statusEl = document.getElementById("status");
  const form = document.getElementById("connect");
  const term = new Terminal({ cursorBlink: true, scrollback: 5000, allowProposedApi: false });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(document.getElementById("terminal"));
  fit.fit();

  let token = params.get("token");
  let session = params.get("session");
  let mode = params.get("mode") === "observe" ? "observe" : "control";
  let lastSeq = null;
  let ws = null;
  let finished = false;
  let retries = 0;

  function setState(state, text) {
    document.body.dataset.state = state;
    statusEl.textContent = text;
  }

  function send(frame) {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(frame));
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    ws = new WebSocket(`${scheme}://${location.host}/pty`);
    setState("connecting", "connecting…");
    ws.onopen = () => {
      const open = { type: "open", token, cols: term.cols, rows: term.rows, mode };
      if (session) open.session = session;
      if (session && lastSeq !== null) open.since = lastSeq;
      ws.send(JSON.stringify(open));
    };
    ws.onmessage = (ev) => {
      const f = JSON.parse(ev.data);
      switch (f.type) {
        case "opened":
          session = f.session;
          retries = 0;
          document.body.dataset.session = f.session;
          setState("open", `${f.mode} · ${f.session}`);
          if (f.mode === "control") term.focus();
          break;
        case "output":
          term.write(f.data);
          lastSeq = f.seq;
          break;
        case "resync":
          term.reset();
          lastSeq = f.seq;
          break;
        case "exit":
          finished = true;
          setState("exited", `exited with code ${f.code}`);
          break;
        case "error":
          finished = true;
          setState("refused", `${f.refusal}: ${f.message}`);
          break;
      }
    };
    ws.onclose = (ev) => {
      ws = null;
      if (finished || ev.code === 1000 || (ev.code >= 4400 && ev.code < 4500)) {
        if (!finished) setState("closed", `closed (${ev.code})`);
        return;
      }
      // Dropped: resume the same session from the last seq, backing off.
      retries += 1;
      if (retries > 8 || !session) {
        setState("closed", `disconnected (${ev.code})`);
        return;
      }
      setState("reconnecting", `reconnecting (${retries})…`);
      setTimeout(connect, Math.min(250 * 2 ** retries, 8000));
    };
  }

  term.onData((data) => {
    if (mode !== "control") return;
    for (let i = 0; i < data.length; i += MAX_INPUT_CHARS) {
      send({ type: "input", data: data.slice(i, i + MAX_INPUT_CHARS) });
    }
  });
  term.onResize(({ cols, rows }) => {
    if (mode === "control") send({ type: "resize", cols, rows });
  });
  window.addEventListener("resize", () => fit.fit());

  if (token) {
    connect();
  } else {
    form.hidden = false;
    if (session) document.getElementById("session").value = session;
    document.getElementById("mode").value = mode;
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      token = document.getElementById("token").value.trim();
      session = document.getElementById("session").value.trim() || null;
      mode = document.getElementById("mode").value;
      form.hidden = true;
      connect();
    });
  }
})();
