"""mnemo's MCP server through the official Python MCP client (`mcp` on PyPI), over both transports.

Run by tests/mcp.rs, which starts mnemo-server and passes, in the environment:
  MCP_URL        the server's /mcp endpoint (streamable HTTP)
  MNEMO_URL      the server's base URL, for the stdio binary to forward to
  MNEMO_MCP_BIN  the mnemo-mcp binary (stdio)
  TOKEN_A        a token of tenant A with a user, an agent and a session
  TOKEN_B        a token of tenant B with the same user, agent and session names
Exits non-zero, with the failed check in its traceback, when anything is not as expected.
"""

import asyncio
import contextlib
import json
import os
import tempfile

import httpx2
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

TOOLS = {
    "recall": ["query"],
    "memory_pack": ["query"],
    "remember": ["source_kind", "source_ref", "content"],
    "remember_fact": ["content", "scope"],
    "forget": ["id"],
    "get_tool_output": ["key"],
    "list_files": [],
    "read_file": ["path"],
    "write_file": ["path", "content"],
    "edit_file": ["path", "old_text", "new_text"],
}


def check(condition, what):
    if not condition:
        raise AssertionError(what)


@contextlib.asynccontextmanager
async def session(transport, token):
    """An initialised client session over `transport` ("http" or "stdio") with `token`."""
    if transport == "http":
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http:
            async with streamable_http_client(os.environ["MCP_URL"], http_client=http) as (read, write, *_):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    yield s
    else:
        env = {"MNEMO_URL": os.environ["MNEMO_URL"], "MNEMO_TOKEN": token, "MNEMO_LOG": "warn"}
        params = StdioServerParameters(command=os.environ["MNEMO_MCP_BIN"], args=[], env=env)
        async with stdio_client(params) as (read, write, *_):
            async with ClientSession(read, write) as s:
                await s.initialize()
                yield s


async def call(s, tool, args):
    """The tool's answer: (ok, structured content)."""
    result = await s.call_tool(tool, args)
    check(result.structured_content is not None, f"{tool}: no structured content")
    check(json.loads(result.content[0].text) == result.structured_content, f"{tool}: text and structure differ")
    return (not result.is_error, result.structured_content)


async def ok(s, tool, args):
    good, body = await call(s, tool, args)
    check(good, f"{tool}({args}) failed: {body}")
    return body


async def refused(s, tool, args, code):
    good, body = await call(s, tool, args)
    check(not good, f"{tool}({args}) should fail with {code}: {body}")
    check(body["error"]["code"] == code, f"{tool}({args}): expected {code}, got {body}")


async def schemas(s):
    listed = {t.name: t for t in (await s.list_tools()).tools}
    check(set(listed) == set(TOOLS), f"tools: {sorted(listed)}")
    for name, required in TOOLS.items():
        tool = listed[name]
        schema = tool.input_schema
        check(schema["type"] == "object" and schema["additionalProperties"] is False, f"{name}: schema {schema}")
        check(sorted(schema.get("required", [])) == sorted(required), f"{name}: required {schema.get('required')}")
        check(all(r in schema["properties"] for r in required), f"{name}: a required argument is undescribed")
        check(len(tool.description or "") >= 40, f"{name}: no description an agent can act on")
    check(listed["recall"].annotations.read_only_hint is True, "recall is read-only")
    check(listed["forget"].annotations.destructive_hint is True, "forget is destructive")
    check(listed["edit_file"].annotations.destructive_hint is True, "edit_file replaces text")
    check(listed["remember_fact"].annotations.destructive_hint is True, "remember_fact may retire an older fact")
    check(listed["write_file"].annotations.idempotent_hint is False, "each write_file is a new version")
    scope = listed["recall"].input_schema["properties"]["scope"]["enum"]
    check(scope == ["session", "tenant", "user", "agent", "any"], f"recall scopes {scope}")


async def every_tool(transport):
    """Each tool once with tenant A, its effects checked; returns what tenant B must not reach."""
    tag = f"zebrafinch{transport}"  # a word only this transport's rows hold
    async with session(transport, os.environ["TOKEN_A"]) as s:
        await schemas(s)
        msg = await ok(s, "remember", {"source_kind": "chat_message", "source_ref": f"{transport}-m1",
                                       "content": f"The {tag} nests in the old barn", "role": "user"})
        check(msg["was_new"] is True, f"first write is new: {msg}")
        again = await ok(s, "remember", {"source_kind": "chat_message", "source_ref": f"{transport}-m1",
                                         "content": f"The {tag} nests in the old barn", "role": "user"})
        check(again == {"id": msg["id"], "was_new": False}, f"a repeated write changes nothing: {again}")
        fact = await ok(s, "remember_fact", {"content": f"The user feeds the {tag} every morning", "scope": "user",
                                             "category": "preference", "importance": 0.8, "tags": ["birds"]})
        big = ("x" * 20_000) + f" {tag} end"
        await ok(s, "remember", {"source_kind": "tool_output", "source_ref": f"{transport}-call-1", "content": big,
                                 "name": "fetch"})
        found = await ok(s, "recall", {"query": tag, "top_k": 10})
        ids = {item["id"] for item in found["items"]}
        check(msg["id"] in ids and fact["id"] in ids, f"recall finds the message and the fact: {found}")
        preview = next(i["content"] for i in found["items"] if i["source_kind"] == "tool_output")
        key = preview.split("tool output ")[1].split(" ")[0]
        check(key.startswith("tout_"), f"preview names a key: {key}")
        full = await ok(s, "get_tool_output", {"key": key})
        check(full["content"] == big and full["next_offset"] is None, "get_tool_output gives the whole payload")
        pages, offset = [], 0
        while offset is not None:
            page = await ok(s, "get_tool_output", {"key": key, "offset": offset, "max_bytes": 8192})
            check(len(page["content"]) <= 8192 and page["total_bytes"] == len(big), f"a page: {page['offset']}")
            pages.append(page["content"])
            offset = page["next_offset"]
        check(len(pages) == 3 and "".join(pages) == big, "get_tool_output's pages join to the whole payload")
        pack = await ok(s, "memory_pack", {"query": tag, "max_budget_tokens": 500})
        check(pack["rendered"].startswith("# Memory") and tag in pack["rendered"], f"pack: {pack['rendered'][:200]}")
        check(pack["diagnostics"]["tokens"] <= 500, "pack within budget")

        path = f"memory/{transport}-notes.md"
        written = await ok(s, "write_file", {"path": path, "content": f"# Notes\n\nSaw a {tag}.\n"})
        check(written["result"] == "created", f"write_file: {written}")
        edited = await ok(s, "edit_file", {"path": path, "old_text": "Saw a", "new_text": "Fed a"})
        check(edited["version"] == 2, f"edit_file: {edited}")
        read = await ok(s, "read_file", {"path": path})
        check(read["content"] == f"# Notes\n\nFed a {tag}.\n", f"read_file: {read}")
        listed = await ok(s, "list_files", {"prefix": "memory/"})
        check(path in [f["path"] for f in listed["files"]], f"list_files: {listed}")
        first = await ok(s, "list_files", {"limit": 1})
        rest = await ok(s, "list_files", {"cursor": first["next_cursor"]})
        every = await ok(s, "list_files", {})
        check(first["files"] + rest["files"] == every["files"] and rest["next_cursor"] is None,
              f"list_files pages: {first} {rest}")
        await refused(s, "edit_file", {"path": path, "old_text": "not there", "new_text": "y"}, "edit_text_not_found")

        # bad arguments: the API's codes, nothing written
        await refused(s, "remember", {"source_kind": "chat_message", "source_ref": "bad-1"}, "missing_field")
        await refused(s, "remember", {"source_kind": "email", "source_ref": "bad-2", "content": "x"}, "invalid_value")
        await refused(s, "recall", {"query": tag, "tenant_id": "other"}, "tenant_in_body")
        await refused(s, "get_tool_output", {"key": key, "tenant": "other"}, "tenant_in_body")
        await refused(s, "remember_fact", {"content": "x", "scope": "user", "user_id": "someone"}, "unknown_field")
        await refused(s, "remember", {"source_kind": "chat_message", "source_ref": "bad-3", "content": "x",
                                      "session_id": "another-session"}, "session_mismatch")
        await refused(s, "recall", {"query": tag, "top_k": "five"}, "invalid_field")
        await refused(s, "forget", {}, "missing_field")
        await refused(s, "forget", {"id": "not-a-uuid"}, "invalid_field")
        await refused(s, "list_files", {"prefix": "memory/", "owner": "x"}, "unknown_field")
        await refused(s, "read_file", {"path": "../etc/passwd.md"}, "invalid_path")
        try:
            await s.call_tool("no_such_tool", {})
            check(False, "an unknown tool is refused")
        except Exception as e:  # an MCP protocol error, not a tool result
            check("no_such_tool" in str(e), f"unknown tool error: {e}")

        victim = await ok(s, "remember", {"source_kind": "chat_message", "source_ref": f"{transport}-m2",
                                          "content": f"Where does the {tag} go in winter?"})
        return {"tag": tag, "message": msg["id"], "key": key, "path": path, "victim": victim["id"]}


async def isolation(transport, a):
    """Tenant B, with the same user, agent and session names, reaches none of A's rows."""
    async with session(transport, os.environ["TOKEN_B"]) as s:
        found = await ok(s, "recall", {"query": a["tag"], "top_k": 20})
        check(found["items"] == [], f"tenant B recalls nothing of A: {found}")
        await refused(s, "get_tool_output", {"key": a["key"]}, "not_found")
        await refused(s, "forget", {"id": a["victim"]}, "not_found")
        await refused(s, "read_file", {"path": a["path"]}, "not_found")
    async with session(transport, os.environ["TOKEN_A"]) as s:
        found = await ok(s, "recall", {"query": a["tag"], "top_k": 20})
        check(a["victim"] in {i["id"] for i in found["items"]}, "B's forget left A's row alone")
        gone = await ok(s, "forget", {"id": a["victim"]})
        check(gone["already_deleted"] is False, f"forget: {gone}")
        found = await ok(s, "recall", {"query": a["tag"], "top_k": 20})
        check(a["victim"] not in {i["id"] for i in found["items"]}, "a forgotten row is not recalled")


async def bad_token(transport):
    forged = os.environ["TOKEN_A"][:-4] + ("AAAA" if not os.environ["TOKEN_A"].endswith("AAAA") else "BBBB")
    if transport == "http":
        # /mcp answers 401 with the API's error body before any MCP message is read.
        async with httpx2.AsyncClient() as http:
            init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
            headers = {"Authorization": f"Bearer {forged}", "Accept": "application/json, text/event-stream"}
            answer = await http.post(os.environ["MCP_URL"], json=init, headers=headers)
            check(answer.status_code == 401, f"forged token over HTTP: {answer.status_code}")
            check(answer.json()["error"]["code"] == "invalid_token", f"forged token: {answer.text}")
        # A new connection: the server answered before reading the body, and may close the first.
        async with httpx2.AsyncClient() as http:
            answer = await http.post(os.environ["MCP_URL"], json=init, headers={"Accept": headers["Accept"]})
            check(answer.status_code == 401 and answer.json()["error"]["code"] == "missing_token", answer.text)
        # Through the official client too: its connection fails on the 401 (seen by a hook, as the
        # client's own error does not carry the status).
        statuses = []

        async def record(response):
            statuses.append(response.status_code)

        hooks = {"response": [record]}
        try:
            async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {forged}"}, event_hooks=hooks) as http:
                async with streamable_http_client(os.environ["MCP_URL"], http_client=http) as (read, write, *_):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
            check(False, "the client cannot connect with a forged token")
        except AssertionError:
            raise
        except BaseException:  # an exception group in 2.x; the hook tells why
            check(statuses and set(statuses) == {401}, f"the refusals are 401s: {statuses}")
    else:
        # The stdio server starts (it cannot verify a token), and every call is refused by the API.
        async with session("stdio", forged) as s:
            await refused(s, "recall", {"query": "anything"}, "invalid_token")


def credentials_refused():
    """mnemo-mcp with a user and password in MNEMO_URL: refused at start (the HTTP client would
    send them as a second Authorization header), without showing the password."""
    import subprocess

    env = {"MNEMO_URL": "http://ops:s3cret@127.0.0.1:9", "MNEMO_TOKEN": os.environ["TOKEN_A"]}
    done = subprocess.run([os.environ["MNEMO_MCP_BIN"]], env=env, capture_output=True, text=True, timeout=30)
    check(done.returncode != 0, f"it started: {done.stderr}")
    check("user and password" in done.stderr, f"the refusal says why: {done.stderr}")
    check("s3cret" not in done.stderr, f"the URL's password stays out of the refusal: {done.stderr}")


async def unreachable():
    """mnemo-mcp whose API is down: a tool error the agent sees, and no path in its log."""
    env = {"MNEMO_URL": "http://127.0.0.1:9", "MNEMO_TOKEN": os.environ["TOKEN_A"], "MNEMO_LOG": "info"}
    params = StdioServerParameters(command=os.environ["MNEMO_MCP_BIN"], args=[], env=env)
    with tempfile.TemporaryFile(mode="w+") as log:
        async with stdio_client(params, errlog=log) as (read, write, *_):
            async with ClientSession(read, write) as s:
                await s.initialize()
                await refused(s, "read_file", {"path": "memory/secret-plan.md"}, "unavailable")
        log.seek(0)
        text = log.read()
    check("could not reach the API" in text, f"the failure is logged: {text}")
    check("secret-plan" not in text, f"the call's path stays out of the log: {text}")


async def redirecting():
    """mnemo-mcp whose MNEMO_URL answers with a redirect: not followed (the token would go where it
    points, and a POST would come back a GET), and the tool error names where it points."""
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        seen = []

        def answer(self):
            Redirect.seen.append(self.path)
            self.send_response(301)
            self.send_header("Location", "https://mnemo.example/moved")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"MNEMO_URL": f"http://127.0.0.1:{server.server_port}", "MNEMO_TOKEN": os.environ["TOKEN_A"]}
        params = StdioServerParameters(command=os.environ["MNEMO_MCP_BIN"], args=[], env=env)
        async with stdio_client(params) as (read, write, *_):
            async with ClientSession(read, write) as s:
                await s.initialize()
                good, body = await call(s, "recall", {"query": "anything"})
        check(not good and "redirect to https://mnemo.example/moved" in body["error"]["message"], f"{body}")
        check(len(Redirect.seen) == 1, f"the redirect was followed: {Redirect.seen}")
    finally:
        server.shutdown()


async def main():
    for transport in ("http", "stdio"):
        a = await every_tool(transport)
        await isolation(transport, a)
        await bad_token(transport)
        print(f"{transport}: every tool, bad arguments, isolation and a bad token checked", flush=True)
    credentials_refused()
    await unreachable()
    await redirecting()
    print("stdio: an unreachable API and a redirect checked", flush=True)


if __name__ == "__main__":
    asyncio.run(main())  # a failed check raises, and Python exits 1 with its traceback
