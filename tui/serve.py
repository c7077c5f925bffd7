"""`eyas tui --serve`: the same Textual app in a browser, through textual-serve, on a loopback address behind a random token that every URL must carry.

textual-serve runs the app as a subprocess per browser tab (`<python> -m eyas.cli.main --home
<home> tui ...`, so it reads the same store and finds the same daemon socket) and relays its
terminal over a websocket. Everything it serves lives under `/<token>/`: the page, its static
files and the websocket, so the token the page was opened with is the token its websocket
carries, with no cookie or query string to forward (textual.js appends `?width=&height=` to the
websocket URL the page names, which rules out a query-string token). A request whose first
path segment is not the token gets 403, whatever it asks for.

Loopback only (127.0.0.1 by default, reached from elsewhere through `ssh -L`): any other bind
address is refused unless the user passes --i-know-this-is-not-loopback, and then warned about on
stderr, since the traffic is plain HTTP and the served app controls the user's runs.

The page asks nothing of any other host: textual-serve's template links a Google Fonts
stylesheet, which would tell Google each time a user opens their runs and stalls the page on an
air-gapped cluster; its link is dropped as the template loads, and the page uses the
template's local fallback (menlo, monospace).
"""

from __future__ import annotations

import getpass
import ipaddress
import re
import secrets
import shlex
import socket
import sys
from pathlib import Path

NOT_LOOPBACK_FLAG = "--i-know-this-is-not-loopback"
DEFAULT_HOST = "127.0.0.1"
# A <link> or <script> whose address is absolute (another host) rather than under the token.
_OUTSIDE = re.compile(r"<(link|script)\b[^>]*\b(href|src)=\"(https?:)?//[^\"]*\"[^>]*>(\s*</script>)?", re.S)


def local_only(html: str) -> str:
    """`html` without the tags that load anything from another host."""
    return _OUTSIDE.sub("", html)


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and the name localhost; any other name or address is not (a name
    could resolve anywhere, so it needs the explicit flag)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, allow_other: bool, err=None) -> int | None:
    """None when `host` may be bound; else the exit code, with the reason on stderr. A
    non-loopback address with the flag is allowed and warned about."""
    err = err or sys.stderr
    if is_loopback(host):
        return None
    if not allow_other:
        print(
            f"eyas tui: --host {host} is not a loopback address; the browser view binds 127.0.0.1 only "
            f"(reach it from another machine with `ssh -L`), unless you pass {NOT_LOOPBACK_FLAG}",
            file=err,
        )
        return 2
    print(
        f"eyas tui: WARNING: serving on {host}, which is not loopback ({NOT_LOOPBACK_FLAG}): anyone who can "
        "reach it and learns the URL controls your runs, and plain HTTP carries the token unencrypted",
        file=err,
    )
    return None


def app_command(home: Path, run_id: int | None, readonly: bool) -> str:
    """The shell command textual-serve starts per browser tab: this interpreter, this eyas, the
    same state directory (its socket follows from it and the inherited environment)."""
    argv = [sys.executable, "-m", "eyas.cli.main", "--home", str(home), "tui"]
    argv += [str(run_id)] if run_id is not None else []
    argv += ["--readonly"] if readonly else []
    return shlex.join(argv)


def _url_host(host: str) -> str:
    return f"[{host.strip('[]')}]" if ":" in host else host


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is printed, so that the URL names the real
    port (port 0: one the kernel picks) and a port in use fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def _stop(service, wait: float = 5.0) -> None:
    """Ask a session's app to quit, and kill it if it has not within `wait` seconds."""
    import asyncio

    try:
        await asyncio.wait_for(service.stop(), wait)
    except (TimeoutError, asyncio.CancelledError):
        process = service._process
        if process is not None and process.returncode is None:
            process.kill()


def make_server(command: str, token: str, title: str = "eyas"):
    """A textual-serve Server whose every route lives under `/<token>/`, with a middleware
    that answers 403 to anything else."""
    import asyncio

    import aiohttp_jinja2
    import jinja2
    from aiohttp import WSCloseCode, web
    from textual_serve.server import Server, to_int

    class LocalTemplates(jinja2.FileSystemLoader):
        def get_source(self, environment, template):
            source, filename, uptodate = super().get_source(environment, template)
            return local_only(source), filename, uptodate

    prefix = f"/{token}"
    sessions: set[web.WebSocketResponse] = set()

    @web.middleware
    async def require_token(request: web.Request, handler):
        first = request.path.lstrip("/").split("/", 1)[0]
        # compare_digest: the time a comparison takes says nothing about how much of it matched.
        if not secrets.compare_digest(first.encode(), token.encode()):
            raise web.HTTPForbidden(text="eyas tui --serve: open the URL the command printed (it carries the token)\n")
        return await handler(request)

    class TokenServer(Server):
        async def _make_app(self) -> web.Application:
            app = web.Application(middlewares=[require_token])
            aiohttp_jinja2.setup(app, loader=LocalTemplates(self.templates_path))
            app.add_routes(
                [
                    web.get(prefix, self.handle_bare),
                    web.get(prefix + "/", self.handle_index, name="index"),
                    web.get(prefix + "/ws", self.handle_websocket, name="websocket"),
                    web.get(prefix + "/download/{key}", self.handle_download, name="download"),
                    web.static(prefix + "/static", self.statics_path, name="static"),
                ]
            )
            app.on_startup.append(self.on_startup)
            app.on_shutdown.append(self.on_shutdown)
            return app

        async def handle_bare(self, request: web.Request) -> web.Response:
            raise web.HTTPFound(prefix + "/")

        @aiohttp_jinja2.template("app_index.html")
        async def handle_index(self, request: web.Request) -> dict:
            # URLs from the request's own Host rather than the bind address, so the page works
            # through `ssh -L` from any local port.
            scheme = "wss" if request.secure else "ws"
            return {
                "font_size": to_int(request.query.get("fontsize", "16"), 16),
                "app_websocket_url": f"{scheme}://{request.host}{prefix}/ws",
                "config": {"static": {"url": prefix + "/static/"}},
                "application": {"name": self.title},
            }

        async def on_startup(self, app: web.Application) -> None:
            """textual-serve prints its logo and URL here; `serve` printed ours already."""

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            """textual-serve's, with each live session registered, so that stopping the server
            ends them (aiohttp would otherwise wait a minute for open tabs), and an app that
            ignores the quit request killed."""
            from textual_serve.server import AppService

            websocket = web.WebSocketResponse(heartbeat=15, timeout=2)
            service = None
            sessions.add(websocket)
            try:
                await websocket.prepare(request)
                service = AppService(
                    self.command,
                    write_bytes=websocket.send_bytes,
                    write_str=websocket.send_str,
                    close=websocket.close,
                    download_manager=self.download_manager,
                    debug=self.debug,
                )
                await service.start(
                    to_int(request.query.get("width", "80"), 80), to_int(request.query.get("height", "24"), 24)
                )
                await self._process_messages(websocket, service)
            except asyncio.CancelledError:
                await websocket.close()
            finally:
                sessions.discard(websocket)
                if service is not None:
                    await _stop(service)
            return websocket

        async def on_shutdown(self, app: web.Application) -> None:
            for websocket in list(sessions):
                await websocket.close(code=WSCloseCode.GOING_AWAY, message=b"eyas tui --serve stopped")

    return TokenServer(command, title=title)


def serve(args, home: Path, out=None, err=None) -> int:
    """Serve the TUI until Ctrl-C; the URL (with its token) and the `ssh -L` line go to stdout.
    The bind address was checked already (`check_bind`, by the command, before the store)."""
    import asyncio
    import logging
    import signal

    from aiohttp import web

    out, err = out or sys.stdout, err or sys.stderr
    host = args.host or DEFAULT_HOST
    try:
        sock = bind(host, args.port or 0)
    except OSError as exc:
        print(f"eyas tui: cannot listen on {host}:{args.port or 0}: {exc.strerror or exc}", file=err)
        return 1
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(24)
    server = make_server(app_command(home, args.run, bool(args.readonly)), token)
    url = f"http://{_url_host(host)}:{port}/{token}/"
    print(f"eyas tui: serving the TUI of {home} on {url}", file=out)
    if is_loopback(host):
        print(
            f"  from another machine: ssh -N -L {port}:127.0.0.1:{port} {getpass.getuser()}@{socket.gethostname()}"
            f"  then open http://127.0.0.1:{port}/{token}/",
            file=out,
        )
    print("  the URL is the key: anyone holding it can use the TUI as you. Ctrl-C stops serving.", file=out, flush=True)
    # textual-serve's own messages (an app that failed to start), without its per-request noise.
    logging.basicConfig(level=logging.WARNING, format="eyas tui: %(message)s")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.request_exit)
    try:
        web.run_app(
            server._make_app(),
            sock=sock,
            handle_signals=False,
            loop=loop,
            print=None,
            access_log=None,
            shutdown_timeout=5.0,  # the sessions were told to close in on_shutdown
        )
    finally:
        sock.close()
    return 0
