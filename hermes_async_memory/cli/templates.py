"""``hermes-memory templates ...``: warm-start templates, and whether warm starts help.

    hermes-memory templates list [--type T] [--tag TAG]... [--json]
    hermes-memory templates show NAME [--json]
    hermes-memory templates test NAME --message TEXT [--text [--max-chars N]]
    hermes-memory templates stats [--json]
    hermes-memory templates export [--out FILE]
    hermes-memory templates extract SESSION --name NAME [--description D] [--tags a,b]
                                   [--type T] [--overwrite] [--json]
    hermes-memory templates delete NAME [--json]
    hermes-memory templates import FILE|- [--json]

Reads are the library's template reads on the store file, opened read-only (no lock,
beside a running worker). The writes go through the durable path, as the library's do: the
CLI opens the store's pipeline (or hands them to the worker that holds it) and waits for
them to commit. ``test`` prints what a new session would send: the chat messages (JSON,
checked as an OpenAI chat request would be) or, with ``--text``, the block a text-only
client gets, followed by the first user message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .common import (
    EXIT_OK,
    db_option,
    guarded,
    json_option,
    one_line,
    positive_int,
    print_json,
    settings_of,
    store_error,
    table,
    template_reads,
    when,
    writing,
)

if TYPE_CHECKING:
    from ..templates import Template

DESCRIPTION_WIDTH = 60  # characters of a description in ``list``
RESULT_WIDTH = 100  # characters of an example's result in ``show``


def register(commands: Any) -> None:
    """Add ``templates`` and its actions to ``commands`` (argparse sub-parsers)."""
    db, as_json = db_option(), json_option()
    templates = commands.add_parser(
        "templates", help="warm-start templates: list, extract, show, test, delete, stats, "
                          "export, import",
        description="Warm-start templates: what a finished session teaches a new one of "
                    "the same kind, and whether warm starts help.",
    ).add_subparsers(dest="templates_command", metavar="ACTION", required=True)
    listing = templates.add_parser(
        "list", parents=[db, as_json], help="the stored templates",
        description="List the templates by task type, then name, with their use and "
                    "success rate.",
    )
    listing.add_argument("--type", dest="task_type", metavar="T",
                         help="only templates of this task type")
    listing.add_argument("--tag", dest="tags", action="append", default=[], metavar="TAG",
                         help="only templates with this tag (repeat for any of several)")
    listing.set_defaults(handler=guarded(_list))
    show = templates.add_parser(
        "show", parents=[db, as_json], help="one template",
        description="Show one template: its counts, context, user requests and examples.",
    )
    show.add_argument("name", metavar="NAME")
    show.set_defaults(handler=guarded(_show))
    test = templates.add_parser(
        "test", parents=[db], help="what a warm start would send",
        description="Print the messages a new session would send with this template for a "
                    "first user message (JSON, checked as a chat request), or with --text "
                    "the text block a text-only client gets.",
    )
    test.add_argument("name", metavar="NAME")
    test.add_argument("--message", required=True, metavar="TEXT",
                      help="the session's first user message")
    test.add_argument("--system", metavar="TEXT", help="a system message before it")
    test.add_argument("--text", action="store_true", help="print the text block instead")
    test.add_argument("--max-chars", type=positive_int, default=None, metavar="N",
                      dest="max_chars", help="the text block's bound (default 2000)")
    test.set_defaults(handler=guarded(_test))
    stats = templates.add_parser(
        "stats", parents=[db, as_json], help="warm against cold starts, per task type",
        description="Per task type, the sessions started warm (from a template) and cold: "
                    "how many, how many ended well, and the tool error rate of their first "
                    "turns (the mean of each session's rate).",
    )
    stats.set_defaults(handler=guarded(_stats))
    export = templates.add_parser(
        "export", parents=[db], help="every template as JSON",
        description="Write every template as one JSON list, for import elsewhere.",
    )
    export.add_argument("--out", "-o", default="-", metavar="FILE",
                        help="where to write (default -, standard output)")
    export.set_defaults(handler=guarded(_export))
    extract = templates.add_parser(
        "extract", parents=[db, as_json], help="make a template of a stored session",
        description="Make a template of a stored session: its successful tool calls, "
                    "instructions, first user requests, and the files and URLs it used.",
    )
    extract.add_argument("session_id", metavar="SESSION")
    extract.add_argument("--name", required=True, metavar="NAME")
    extract.add_argument("--description", metavar="D")
    extract.add_argument("--tags", default="", metavar="a,b", help="comma-separated tags")
    extract.add_argument("--type", dest="task_type", metavar="T",
                         help="its task type (default: classified from its tool calls)")
    extract.add_argument("--overwrite", action="store_true",
                         help="replace a template of that name (its counts stay)")
    extract.set_defaults(handler=guarded(_extract))
    delete = templates.add_parser(
        "delete", parents=[db, as_json], help="delete a template",
        description="Delete a template. The sessions started from it still count in stats.",
    )
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(handler=guarded(_delete))
    imports = templates.add_parser(
        "import", parents=[db, as_json], help="import exported templates",
        description="Import the JSON of an export. A template whose name is stored already "
                    "is left as it is, so a second import changes nothing.",
    )
    imports.add_argument("input", metavar="FILE", help="the export to read (- for stdin)")
    imports.set_defaults(handler=guarded(_import))


# -- reads ------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    from ..templates.model import normalize_tags

    wanted = set(normalize_tags(args.tags))

    async def run() -> list[Template]:
        async with template_reads(settings_of(args)) as reads:
            return await reads.list(args.task_type)

    found = [t for t in anyio.run(run) if not wanted or wanted & set(t.tags)]
    if args.json:
        print_json([_summary(t) for t in found])
    elif not found:
        print("no templates" + (f" of type {args.task_type}" if args.task_type else ""))
    else:
        table(["NAME", "TYPE", "TAGS", "USED", "OK/ENDED", "RATE", "SOURCE", "DESCRIPTION"],
              [[t.name, t.task_type, ",".join(t.tags) or "-", str(t.usage_count),
                f"{t.successes}/{t.ended}", _percent(t.success_rate), t.source_session_id,
                one_line(t.description, DESCRIPTION_WIDTH) or "-"] for t in found])
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    template = _one(args)
    if args.json:
        print_json(template.to_dict())
        return EXIT_OK
    fields = [("name", template.name), ("type", template.task_type),
              ("tags", ", ".join(template.tags) or "-"),
              ("source", template.source_session_id), ("created", when(template.created_at)),
              ("used", f"{template.usage_count} sessions; {template.successes} ended well, "
                       f"{template.failures} badly ({_percent(template.success_rate)})")]
    if template.description:
        fields.append(("about", template.description))
    for name, value in fields:
        print(f"{name.ljust(8)}  {value}")
    for heading, lines in (("files and URLs", template.context_markers),
                           ("user requests", template.user_patterns),
                           ("instructions", template.system_context.splitlines())):
        if lines:
            print(f"\n{heading}:")
            for line in lines:
                print(f"  {line}")
    if template.examples:
        print("\nexamples:")
        for e in template.examples:
            print(f"  {e.tool} {json.dumps(dict(e.arguments), ensure_ascii=False)}")
            print(f"    -> {one_line(e.result, RESULT_WIDTH) or '(no output)'}")
    return EXIT_OK


def _test(args: argparse.Namespace) -> int:
    from ..templates import validate_chat, warm_messages, warm_text
    from ..templates.build import WARM_TEXT_CHARS

    template = _one(args)
    first: list[dict[str, Any]] = [{"role": "user", "content": args.message}]
    if args.system is not None:
        first.insert(0, {"role": "system", "content": args.system})
    if args.text:
        try:
            block = warm_text(template, args.max_chars or WARM_TEXT_CHARS)
        except ValueError as exc:
            raise store_error(str(exc)) from None
        print(block)
        print()
        print(args.message)
        return EXIT_OK
    messages = warm_messages(template, first)
    validate_chat(messages)  # InvalidChatError: exit 2, the message names the culprit
    print_json(messages)
    return EXIT_OK


def _stats(args: argparse.Namespace) -> int:
    settings = settings_of(args)

    async def run() -> list[dict[str, Any]]:
        async with template_reads(settings) as reads:
            return [s.as_dict() for s in await reads.stats()]

    stats = anyio.run(run)
    n = settings.templates.first_turns
    if args.json:
        print_json({"first_turns": n, "task_types": stats})
        return EXIT_OK
    if not stats:
        print("no sessions started warm or cold yet")
        return EXIT_OK
    rows = []
    for s in stats:
        for side in ("warm", "cold"):
            rows.append([s["task_type"], side, *_side(s[side])])
    table(["TYPE", "START", "SESSIONS", "ENDED", "OK", f"ERRORS (FIRST {n} TURNS)",
           "MEASURED"], rows)
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    async def run() -> tuple[str, int]:
        async with template_reads(settings_of(args)) as reads:
            text = await reads.export()
        return text, len(json.loads(text))

    text, n = anyio.run(run)
    if args.out == "-":
        sys.stdout.write(text)
        return EXIT_OK
    path = Path(args.out)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)  # a reader never sees half a file
    finally:
        partial.unlink(missing_ok=True)
    print(f"exported {n} templates to {args.out}")
    return EXIT_OK


# -- writes -----------------------------------------------------------------------------


def _extract(args: argparse.Namespace) -> int:
    tags = [t for t in args.tags.split(",") if t.strip()]

    async def run() -> dict[str, Any]:
        async with writing(settings_of(args)) as mem:
            template = await mem.templates.extract(
                args.session_id, args.name, description=args.description, tags=tags,
                task_type=args.task_type, overwrite=args.overwrite,
                timeout_s=mem.settings.shutdown_deadline_s)
        return template.to_dict()

    done = anyio.run(run)
    if args.json:
        print_json(done)
    else:
        print(f"extracted {done['name']} ({done['task_type']}, {len(done['examples'])} "
              f"examples) from {args.session_id}")
    return EXIT_OK


def _delete(args: argparse.Namespace) -> int:
    settings = settings_of(args)

    async def run() -> None:
        from ..templates import UnknownTemplateError

        async with writing(settings) as mem:
            try:
                await mem.templates.delete(args.name,
                                           timeout_s=mem.settings.shutdown_deadline_s)
            except UnknownTemplateError:
                raise store_error(f"no template {args.name!r} in {settings.db_path}") from None

    anyio.run(run)
    if args.json:
        print_json({"name": args.name, "deleted": True})
    else:
        print(f"deleted {args.name}")
    return EXIT_OK


def _import(args: argparse.Namespace) -> int:
    if args.input == "-":
        text = sys.stdin.read()
    else:
        path = Path(args.input)
        if not path.is_file():
            raise store_error(f"no file {args.input}")
        text = path.read_text(encoding="utf-8")
    total = _count(text)

    async def run() -> int:
        async with writing(settings_of(args)) as mem:
            return await mem.templates.import_(text, timeout_s=mem.settings.shutdown_deadline_s)

    imported = anyio.run(run)
    done = {"imported": imported, "skipped": total - imported}
    if args.json:
        print_json(done)
    else:
        print(f"imported {imported} templates; {done['skipped']} already there, skipped")
    return EXIT_OK


# -- helpers ----------------------------------------------------------------------------


def _one(args: argparse.Namespace) -> Template:
    settings = settings_of(args)

    async def run() -> Template | None:
        async with template_reads(settings) as reads:
            return await reads.get(args.name)

    template = anyio.run(run)
    if template is None:
        raise store_error(f"no template {args.name!r} in {settings.db_path}")
    return template


def _summary(t: Template) -> dict[str, Any]:
    return {"name": t.name, "task_type": t.task_type, "tags": list(t.tags),
            "description": t.description, "source_session_id": t.source_session_id,
            "usage_count": t.usage_count, "successes": t.successes, "failures": t.failures,
            "success_rate": t.success_rate, "examples": len(t.examples),
            "created_at": t.created_at}


def _side(s: dict[str, Any]) -> list[str]:
    """A warm or cold side of a ``StartStats.as_dict`` as table cells."""
    errors = (f"{_percent(s['avg_error_rate'])} (pooled {_percent(s['pooled_error_rate'])})"
              if s["measured"] else "-")
    return [str(s["sessions"]), str(s["ended"]), _percent(s["success_rate"]), errors,
            str(s["measured"])]


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.0f}%"


def _count(text: str) -> int:
    """The templates ``text`` holds, as ``import_`` reads it (0 when it is not JSON: the
    import says why)."""
    try:
        docs = json.loads(text)
    except ValueError:
        return 0
    return 1 if isinstance(docs, dict) else len(docs) if isinstance(docs, list) else 0

