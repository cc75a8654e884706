"""The ``elasticpipe`` command: coordinator, stage, admin, demo, certs and export-hf.

Logging is configured here, once, for whichever command runs (console or JSON lines on
stderr). ``--log-format`` and ``--log-level`` go before the command; the admin options
(``--coordinator``, ``--json``, ``--timeout``) go before or after the admin subcommand.

This module owns the parser and ``main``, and runs the short commands (demo, certs,
export-hf, admin); the two servers' flags and serving loop are in ``serve``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

# gRPC's core logs every failed TLS handshake at INFO on stderr: one line per port scan or
# misconfigured client, which would let anyone flood a server's log. Errors only, unless
# the operator asks for more. Set before gRPC is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from elasticpipe.cli import process, serve
from elasticpipe.cli.serve import ENV_COORDINATOR
from elasticpipe.errors import ElasticPipeError
from elasticpipe.logs import LEVELS, configure_logging

if TYPE_CHECKING:
    from elasticpipe.cli.admin import AdminParser

ENV_LOG_FORMAT = "ELASTICPIPE_LOG_FORMAT"

# ---- commands --------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """Trains the small GPT on the standard library's source on a local cluster."""
    from elasticpipe.demo.run import Events, run_demo

    events = None
    if args.events:
        events = Events.spread_over(
            args.steps,
            slow_at=args.slow_at,
            recover_at=args.recover_at,
            kill_at=args.kill_at,
            slow_stage=args.slow_stage,
            kill_stage=args.kill_stage,
            factor=args.slow_factor,
        )
    return run_demo(
        events=events,
        png=args.png,
        sample_chars=args.sample_chars,
        stages=args.stages,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        micro_batches=args.micro_batches,
        n_layers=args.layers,
        d_model=args.d_model,
        log_dir=args.log_dir,
    )


def cmd_certs(args: argparse.Namespace) -> int:
    """Creates a cluster CA, or issues a certificate with a name and a role."""
    from elasticpipe.security import tls

    if args.certs_command == "init":
        print(f"created {tls.init_ca(args.dir)} and its key (keep ca.key secret)")
    else:
        cert, key = tls.issue(args.dir, args.name, args.role, tuple(args.host), args.out)
        print(f"issued {cert} and {key} for {args.name!r} (role {args.role})")
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    """Writes a checkpoint of ``elasticpipe.models.hf:causal_lm`` as a save_pretrained directory."""
    from elasticpipe.models import hf

    out = hf.save_pretrained(args.checkpoint, args.config, args.out)
    print(f"wrote {out / 'config.json'} and {out / hf.WEIGHTS_FILE}: load with from_pretrained")
    return 0


def cmd_admin(args: argparse.Namespace) -> int:
    """Runs one admin command against the coordinator and prints the result."""
    from elasticpipe.cli.admin import run_admin

    return run_admin(args)


# ---- parser ----------------------------------------------------------------------------


class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Help that keeps the epilog's layout and shows every default worth showing (not
    for required options, flags, empty values, or help that already names its default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            action.required
            or action.default in (None, "", [], False, argparse.SUPPRESS)
            or "default" in text
        ):
            return text
        return super()._get_help_string(action)


def _admin_options(defaults: bool) -> AdminParser:
    """The admin options, accepted before and after the subcommand (only the given ones
    override: the defaults are set once, on the ``admin`` parser)."""
    from elasticpipe.cli.admin import AdminParser

    common = AdminParser(add_help=False)
    kw = (lambda d: {"default": d}) if defaults else (lambda d: {"default": argparse.SUPPRESS})
    common.add_argument(
        "--coordinator",
        metavar="HOST:PORT[,HOST:PORT...]",  # checked by run_admin: errors are JSON with --json
        help=f"HOST:PORT of the coordinator, or of every coordinator of an HA setup: "
        f"commands go to the one that leads (or ${ENV_COORDINATOR})",
        **kw(os.environ.get(ENV_COORDINATOR, "127.0.0.1:7100")),
    )
    common.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (errors too) instead of tables",
        **kw(False),
    )
    common.add_argument(
        "--timeout", type=float, help="seconds to wait for the coordinator's answer", **kw(300.0)
    )
    for flag, what, env in (
        ("--tls-cert", "an admin certificate (PEM)", "ELASTICPIPE_TLS_CERT"),
        ("--tls-key", "its private key (PEM)", "ELASTICPIPE_TLS_KEY"),
        ("--tls-ca", "the cluster CA's certificate (PEM)", "ELASTICPIPE_TLS_CA"),
    ):
        common.add_argument(flag, metavar="FILE", help=f"{what}; or ${env}", **kw(None))
    return common


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(
        prog="elasticpipe", description=__doc__.split("\n\n")[0], formatter_class=Formatter
    )
    parser.add_argument(
        "--log-format",
        choices=["console", "json"],
        default=os.environ.get(ENV_LOG_FORMAT, "console"),
        help=f"how log lines look on stderr (or ${ENV_LOG_FORMAT})",
    )
    parser.add_argument(
        "--log-level", choices=LEVELS, default="info", help="the least severe lines shown"
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to run (COMMAND --help: more)"
    )

    co = sub.add_parser(
        "coordinator", help="run the coordinator (control plane)", formatter_class=Formatter
    )
    serve.coordinator_arguments(co)

    st = sub.add_parser(
        "stage", help="run a stage server (one per device)", formatter_class=Formatter
    )
    serve.stage_arguments(st)

    de = sub.add_parser(
        "demo", help="train a small GPT on a local cluster", formatter_class=Formatter
    )
    de.add_argument("--stages", type=int, default=4, help="stage processes")
    de.add_argument("--steps", type=int, default=160, help="optimizer steps")
    de.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    de.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    de.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    de.add_argument(
        "--layers",
        type=int,
        default=8,
        help="transformer blocks (8 over 4 stages: 2 each, so that moving layers off a slow "
        "stage overloads another, and moving them back pays when it recovers)",
    )
    de.add_argument("--d-model", type=int, default=128, help="width of the model")
    de.add_argument(
        "--sample-chars", type=int, default=200, help="characters of text generated at the end"
    )
    de.add_argument(
        "--log-dir", default=None, help="keep the processes' logs here (default: under runs/)"
    )
    de.add_argument(
        "--events",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="slow a stage down, let it recover, kill one, and plot it (--no-events: a plain run)",
    )
    for flag, what, fraction in (
        ("--slow-at", "slow --slow-stage down", "1/6"),
        ("--recover-at", "bring it back to full speed", "9/20"),
        ("--kill-at", "kill --kill-stage (SIGKILL)", "3/4"),
    ):
        de.add_argument(
            flag,
            type=int,
            default=None,
            metavar="STEP",
            help=f"after this step, {what} (default: after {fraction} of the steps; 0: never)",
        )
    de.add_argument(
        "--slow-stage", default="", help="the stage slowed down (default: the chain's second)"
    )
    de.add_argument("--slow-factor", type=float, default=3.0, help="how many times slower")
    de.add_argument(
        "--kill-stage", default="", help="the stage killed (default: the chain's third)"
    )
    de.add_argument(
        "--png",
        default=None,
        help="where to draw steps/s and the partition over time (default: LOG_DIR/demo.png)",
    )
    de.set_defaults(func=cmd_demo)

    ce = sub.add_parser(
        "certs", help="a cluster CA and certificates for mutual TLS", formatter_class=Formatter
    )
    cesub = ce.add_subparsers(
        dest="certs_command", required=True, metavar="CERTS_COMMAND", help="init or issue"
    )
    ci = cesub.add_parser(
        "init", help="create DIR/ca.pem and DIR/ca.key", formatter_class=Formatter
    )
    ci.add_argument("dir", help="folder for the CA")
    cs = cesub.add_parser(
        "issue",
        help="issue DIR/NAME.pem and DIR/NAME.key signed by DIR's CA",
        formatter_class=Formatter,
    )
    cs.add_argument("dir", help="folder holding ca.pem and ca.key")
    cs.add_argument(
        "--name",
        required=True,
        help="the party's name (a stage: its --name); 'prefix*' makes one certificate for "
        "every stage whose name starts with prefix (a StatefulSet's pods)",
    )
    cs.add_argument(
        "--role",
        required=True,
        choices=["coordinator", "stage", "client", "admin"],
        help="what the party may call (see the role table in docs/security.md)",
    )
    cs.add_argument(
        "--host",
        action="append",
        default=[],
        help="a DNS name or IP address the party serves at (repeatable; loopback is always "
        "in; '*.svc.example' covers every name one level below)",
    )
    cs.add_argument(
        "--out",
        default="",
        metavar="FILE_NAME",
        help="base name of the files written (default: the --name); needed for a family",
    )
    ce.set_defaults(func=cmd_certs)

    ex = sub.add_parser(
        "export-hf",
        help="write a checkpoint of a Hugging Face model as a save_pretrained directory",
        formatter_class=Formatter,
    )
    ex.add_argument("checkpoint", help="a checkpoint directory written by pipe.save")
    ex.add_argument("out", help="the directory to write config.json and model.safetensors in")
    ex.add_argument(
        "--config",
        default=None,
        metavar="DIR",
        help="a directory holding the model's config.json (default: the checkpoint's model_kwargs)",
    )
    ex.set_defaults(func=cmd_export_hf)

    ad = sub.add_parser(
        "admin",
        help="inspect and rebalance a running cluster",
        parents=[_admin_options(defaults=True)],
        formatter_class=Formatter,
    )
    from elasticpipe.cli.admin import AdminParser

    adsub = ad.add_subparsers(
        dest="admin_command",
        parser_class=AdminParser,  # usage errors as JSON with --json
        required=True,
        metavar="ADMIN_COMMAND",
        help="what to look at or change (ADMIN_COMMAND --help: more)",
    )
    options = [_admin_options(defaults=False)]

    def admin(name: str, help_text: str, epilog: str | None = None) -> argparse.ArgumentParser:
        return adsub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=epilog,
            parents=options,
            formatter_class=argparse.RawDescriptionHelpFormatter if epilog else Formatter,
        )

    from elasticpipe.cli.admin import STATUS_HELP

    status = admin(
        "status", "stages, their state and speed, the partition and its history", STATUS_HELP
    )
    status.add_argument("--all", action="store_true", help="the history of every job")
    status.add_argument(
        "--watch", action="store_true", help="a live view, redrawn every --interval (Ctrl-C ends)"
    )
    status.add_argument("--interval", type=float, default=2.0, help="seconds between two polls")
    status.add_argument("--count", type=int, default=0, help="stop after N polls (0: never)")
    admin("plan", "the current partition next to the optimal one (changes nothing)")
    rb = admin("rebalance", "move to the optimal partition now")
    rb.add_argument(
        "--dry-run", action="store_true", help="show the target, gain and bytes; move nothing"
    )
    sp = admin("set-partition", "move to your own partition, e.g. 0:6,6:12,12:18")
    sp.add_argument("ranges", help="LO:HI layer ranges in chain order, comma-separated")
    sp.add_argument("--stages", nargs="*", default=[], help="new chain order (names or ids)")
    sl_ = admin(
        "set-layout",
        "move to your own replicas, e.g. 0:3,3:7 0:2,2:5,5:7 (one pipeline per argument)",
        "docs/replicas.md",
    )
    sl_.add_argument("replicas", nargs="+", help="per replica: LO:HI ranges in chain order")
    sl_.add_argument(
        "--stages",
        nargs="*",
        default=[],
        help="per replica: its stages, comma-separated (names or ids); default: as now",
    )
    sl_.add_argument(
        "--shares", default="", help="micro-batches per replica, e.g. 5,3; default: planned"
    )
    dr = admin("drain", "move every layer off a stage and keep it out")
    dr.add_argument("stage", help="name or id")
    ud = admin("undrain", "let a drained stage back into the chain")
    ud.add_argument("stage", help="name or id")
    fo = admin("forget", "remove a dead stage from membership")
    fo.add_argument("stage", help="name or id")
    sl = admin("slowdown", "emulate a slower device on a stage (tests, demos)")
    sl.add_argument("stage", help="name or id")
    sl.add_argument("factor", type=float, help="how many times slower (1: normal)")
    tr = admin(
        "trace",
        "every stage's timeline of the last steps as Chrome/Perfetto JSON (and a PNG)",
        "open the JSON in https://ui.perfetto.dev or chrome://tracing; docs/tracing.md",
    )
    tr.add_argument("--steps", type=int, default=1, help="how many of the last steps")
    tr.add_argument("--out", required=True, metavar="FILE", help="the trace JSON to write")
    tr.add_argument("--png", metavar="FILE", help="also draw the pipeline timeline here")
    au = admin("auto", "turn automatic rebalancing on or off (remembered across restarts)")
    au.add_argument("state", choices=["on", "off"], help="on or off")
    ad.set_defaults(func=cmd_admin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``elasticpipe`` command; run as the program (no ``argv``), a
    coordinator or stage ends its process once stopped (``elasticpipe.cli.process``)."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        code = int(args.func(args))
    except ElasticPipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    if argv is None and args.func in (serve.cmd_coordinator, serve.cmd_stage):
        process.end(code)
    return code
