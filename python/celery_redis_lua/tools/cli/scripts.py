"""``scripts list|load|verify|show``: the Lua scripts on a server; ``acl``: the ACL user that may
run them."""

from __future__ import annotations

import json
from itertools import takewhile

import click

from ...protocol import acl
from ...protocol.contract import load_scripts, read_manifest
from .broker import connect, connection_options
from .output import JSON_OPTION, PROG, CliError, table
from .root import main


@main.group()
def scripts() -> None:
    """The Lua scripts: list, load, verify, show."""


@scripts.command("list")
@JSON_OPTION
@connection_options
def scripts_list(as_json: bool, url: str, prefix: str) -> None:
    """Name, contract version, SHA1, and whether the server's script cache holds it."""
    lib = connect(url, prefix)
    files = load_scripts()
    loaded = lib.client.script_exists(*(s.sha1 for s in files.values()))
    rows = [(name, s.contract.version, s.sha1, bool(here))
            for (name, s), here in zip(files.items(), loaded, strict=True)]
    if as_json:
        click.echo(json.dumps([{"script": n, "version": v, "sha1": h, "loaded": i} for n, v, h, i in rows]))
        return
    click.echo(table(["script", "version", "sha1", "loaded"],
                     [(*row[:3], "yes" if row[3] else "no") for row in rows]))


@scripts.command("load")
@connection_options
def scripts_load(url: str, prefix: str) -> None:
    """SCRIPT LOAD every script; print name and SHA1."""
    lib = connect(url, prefix)
    files = load_scripts()
    for name, sha1 in lib.runner.load().items():
        if sha1 != files[name].sha1:
            raise CliError(f"the server hashed {name} to {sha1}, the file is {files[name].sha1}")
        click.echo(f"{name} {sha1}")


@scripts.command("verify")
@connection_options
def scripts_verify(url: str, prefix: str) -> None:
    """Exit 1 unless the server's cache holds every file's SHA1 (and the files match the manifest)."""
    lib = connect(url, prefix)
    files, manifest = load_scripts(), read_manifest()
    loaded = lib.client.script_exists(*(s.sha1 for s in files.values()))
    problems = 0
    for (name, script), here in zip(files.items(), loaded, strict=True):
        pinned = manifest.get(name, {}).get("sha1")
        status = "ok" if here else "not loaded"
        if pinned != script.sha1:
            status = f"file differs from lua/manifest.json ({pinned})"
        problems += status != "ok"
        click.echo(f"{name} {script.sha1} {status}")
    if problems:
        raise CliError(f"{problems} of {len(files)} scripts failed verification "
                       f"(load them with: {PROG} scripts load)")


@scripts.command("show")
@click.argument("name")
@connection_options
def scripts_show(name: str, url: str, prefix: str) -> None:
    """Print a script's header contract (reads the file only; no server is contacted)."""
    files = load_scripts()
    if name not in files:
        raise CliError(f"no script named {name!r}; scripts: {', '.join(files)}")
    lines = files[name].source.decode().splitlines()
    click.echo("\n".join([lines[0], *takewhile(lambda line: line.startswith("--"), lines[1:])]))


@main.command("acl")
@click.option("--role", type=click.Choice(acl.ROLES), required=True,
              help="worker: consumes (and publishes); producer: only publishes; exporter: reads metrics.")
@click.option("--user", default=None, help="ACL user name. Default: celery-<role>.")
@click.option("--prefix", required=True, help="The transport's global_keyprefix (required).")
@click.option("--durability", is_flag=True, help="Also WAIT and WAITAOF (the durability option).")
@click.option("--no-unblock", is_flag=True,
              help="Without CLIENT UNBLOCK (@admin): waits then end by closing their connection.")
def acl_command(role: str, user: str | None, prefix: str, durability: bool, no_unblock: bool) -> None:
    """Print the ACL SETUSER line of a least-privilege user (no server is contacted).

    Replace PASSWORD, and type it at the redis-cli prompt (in a shell, quote '>PASSWORD')."""
    try:
        line = acl.setuser(user or f"celery-{role}", role, prefix, durability=durability,
                           unblock=not no_unblock)
    except ValueError as error:
        raise CliError(f"bad --user or --prefix: {error}") from None
    click.echo(" ".join(line))
