"""Bounded matchers: agents' globs and regexes matched in bounded time, whatever the pattern.

Patterns that reach the daemon from agents (globs, regexes) matched in time linear in
the text, or against a named budget, whatever the pattern. Pure; imports nothing of
substrate but `substrate.errors`. Their users: the workspace policy's globs and
`fs.walk`/`fs.search` (`substrate.workspace`), `artifact.grep` (`substrate.artifacts`).

    glob_regex.py     glob regexes: `re` for simple ones, RE2 for the rest (`GlobRegex`,
                      `compile_sources`)
    re2_translate.py  RE2 translations of a `re` pattern from its own parse: a superset
                      (`superset_of`: `fs.search`'s screen) or the same language (`exact_of`)
    agent_regex.py    agents' regexes: exact RE2 where it can, else mrab-regex against a
                      per-request budget (`Matcher`, `matcher_for`; `limit_exceeded`)
"""
