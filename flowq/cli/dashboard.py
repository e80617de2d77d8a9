"""`flowq dashboard`: the web dashboard (`flowq.dashboard`), served by uvicorn.

The socket is bound here, before anything starts, so a port in use is one sentence and no
half-started server. Binds 127.0.0.1 unless told otherwise. `--allow-actions` needs a login:
`--token` (else one is drawn and printed in a login URL) or `--basic-auth USER:PASSWORD`;
both may also come from the environment, so they stay out of `ps`. The app, optional, is
named as for every command: `MODULE:APP`, `--app MODULE:APP`, or FLOWQ_APP.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket

import click

from flowq.cli.common import (
    app_parameters,
    load_app,
    open_engine,
    schema_option,
    url_option,
)
from flowq.cli.group import UserError
from flowq.errors import ConfigurationError

__all__ = ["dashboard"]


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot serve the dashboard on {host}:{port}: {exc.strerror or exc}. "
                        "Pick another --port (or stop what uses it).") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@click.command("dashboard")
@app_parameters("An app to import, so that run pages show each step's parents and the "
                "leaves' result (optional: the pages work from the database alone)")
@url_option
@schema_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; put auth in front).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port to serve on (0: any free port).")
@click.option("--allow-actions", is_flag=True,
              help="Enable retry, cancel, pause and resume (needs --token or --basic-auth; "
                   "a token is drawn and printed when neither is given).")
@click.option("--token", envvar="FLOWQ_DASHBOARD_TOKEN", default=None, metavar="TOKEN",
              help="Require this token (login form, ?token= or Authorization: Bearer) "
                   "[env FLOWQ_DASHBOARD_TOKEN].")
@click.option("--basic-auth", envvar="FLOWQ_DASHBOARD_BASIC_AUTH", default=None,
              metavar="USER:PASSWORD", help="Require basic auth [env FLOWQ_DASHBOARD_BASIC_AUTH].")
def dashboard(database_url: str | None, schema: str, host: str, port: int, allow_actions: bool,
              token: str | None, basic_auth: str | None, app_spec: str | None) -> None:
    """Serve the web dashboard: queues, workers, runs, dead letters (read-only by default)."""
    from flowq.dashboard import INSTALL_HINT
    try:
        import uvicorn

        from flowq.dashboard.app import create_app
        from flowq.dashboard.auth import parse_basic_auth
    except ImportError as exc:
        raise ConfigurationError(f"{INSTALL_HINT} ({exc.name or exc} is missing)") from None
    credentials = parse_basic_auth(basic_auth) if basic_auth else None
    if app_spec is not None:
        load_app(app_spec)  # registers its definitions, which `get_run` looks up
    drawn = allow_actions and token is None and credentials is None
    if drawn:
        token = secrets.token_urlsafe(24)
    engine = open_engine(database_url, schema)
    try:
        # On a loopback address, answer only to loopback names: a page elsewhere cannot
        # then read the dashboard by pointing its own name at 127.0.0.1 (DNS rebinding).
        hosts = ["localhost", "127.0.0.1", "::1"] if _loopback(host) else None
        app = create_app(engine, schema=schema, allow_actions=allow_actions, token=token,
                         basic_auth=credentials, allowed_hosts=hosts)
        sock = _bind(host, port)
        where = f"http://{f'[{host}]' if ':' in host else host}:{sock.getsockname()[1]}/"
        mode = "actions enabled" if allow_actions else "read-only"
        click.echo(f"flowq dashboard ({mode}) on {where}", err=True)
        if drawn:
            click.echo(f"log in with: {where}?token={token}", err=True)
        if not _loopback(host) and not (token or credentials):
            click.echo(f"warning: the dashboard listens on {host} without a login: anyone who "
                       "can reach it sees job arguments and errors (add --token).", err=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                               lifespan="on"))
        server.run(sockets=[sock])
    finally:
        engine.dispose()
