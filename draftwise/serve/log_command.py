"""`draftwise log stats|export|purge PATH`: read a proposal log (proposal_log.py), or delete from it.

stats: acceptance by draft position (the share of tokens proposed at position i that were kept), by method
and arm, over time (the log cut into equal spans of rows: a falling rate is drift), and the A/B arms of
`serve --experiment` side by side (from the finished requests: acceptance, tokens per target pass, speed,
latency). export: one JSON line
per proposed token whose target token is known, {"context": ids, "target": id, ...}, the pairs a distillation
of the draft trains on. Both read while the server writes (WAL).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from draftwise.files import write_whole
from draftwise.serve.proposal_log import connect


def add_log(commands, formatter) -> None:
    p = commands.add_parser("log", formatter_class=formatter, help="read a proposal log written by serve --proposal-log",
                            description="Read the SQLite proposal log that `draftwise serve --proposal-log PATH` "
                                        "writes (also while the server runs).")
    sub = p.add_subparsers(dest="log_command", metavar="SUBCOMMAND", required=True)
    stats = sub.add_parser("stats", formatter_class=formatter, help="acceptance by position, method and arm, time",
                           description="Acceptance by draft position, by method and arm, and over time (the log "
                                       "cut into --spans equal spans of rows; a falling rate is drift); and the "
                                       "arms of `serve --experiment` compared: requests, proposed, acceptance, "
                                       "mean accepted length, tokens/s, time to first token and between tokens.")
    stats.add_argument("path", metavar="PATH")
    stats.add_argument("--spans", type=int, default=8, metavar="N", help="spans of the over-time table (default: 8)")
    stats.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    stats.set_defaults(func=cmd_log_stats)
    export = sub.add_parser("export", formatter_class=formatter, help="write (context, target token) pairs",
                            description="One JSON line per proposed token whose target token is known: "
                                        '{"context": [ids], "target": id, "proposed": id, "accepted": bool, '
                                        '"method": ..., "arm": ...}; the context is the prompt and output up to '
                                        "that token. Rounds of requests still running are left out.")
    export.add_argument("path", metavar="PATH")
    export.add_argument("--jsonl", required=True, metavar="OUT", help="the file to write ('-' for stdout)")
    export.set_defaults(func=cmd_log_export)
    purge = sub.add_parser("purge", formatter_class=formatter, help="delete users' requests from a log",
                           description="Delete requests (their prompts, outputs and proposed tokens) from a proposal "
                                       "log, also while the server writes it; the deleted bytes are overwritten and "
                                       "the write-ahead file emptied, so nothing of them stays on the disk.")
    purge.add_argument("path", metavar="PATH")
    which = purge.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every request")
    which.add_argument("--older-than", type=float, metavar="DAYS", help="the requests that finished DAYS days ago "
                                                                         "or earlier")
    which.add_argument("--request", action="append", metavar="ID", help="this request (an id the server returned; "
                                                                         "repeat for several)")
    purge.add_argument("--json", action="store_true", help="print what was deleted as one JSON object")
    purge.set_defaults(func=cmd_log_purge)


def cmd_log_stats(args: argparse.Namespace) -> int:
    from draftwise.errors import DraftwiseError

    if args.spans < 1:
        raise DraftwiseError("--spans must be >= 1")
    stats = log_stats(args.path, args.spans)
    print(json.dumps(stats, indent=1) if args.json else format_stats(stats))
    return 0


def cmd_log_export(args: argparse.Namespace) -> int:
    from draftwise.errors import DraftwiseError

    connect(Path(args.path)).close()  # a missing or wrong log fails before anything is written
    if args.jsonl == "-":
        count = export_pairs(args.path, sys.stdout)
    else:
        counted = []

        def write(partial: Path) -> None:
            with open(partial, "w", encoding="utf-8") as out:
                counted.append(export_pairs(args.path, out))

        out = Path(args.jsonl)
        try:  # a file is written whole or not at all (an earlier OUT stays until the new one is complete); a pipe
            # or a device (/dev/stdout, a shell's >(...)) is written as it is
            write_whole(out, write) if not out.exists() or out.is_file() else write(out)
        except OSError as err:
            raise DraftwiseError(f"cannot write {args.jsonl}: {err.strerror or err}") from err
        count = counted[0]
    print(f"wrote {count} pairs to {args.jsonl}", file=sys.stderr)
    return 0


def cmd_log_purge(args: argparse.Namespace) -> int:
    from draftwise.errors import DraftwiseError

    if args.older_than is not None and not args.older_than >= 0:
        raise DraftwiseError(f"--older-than takes days >= 0, got {args.older_than}")
    deleted = purge(args.path, everything=args.all, older_than_s=None if args.older_than is None else
                    args.older_than * 86400, requests=args.request or ())
    print(json.dumps(deleted) if args.json else f"deleted {deleted['requests']} requests and {deleted['rounds']} "
                                                 f"proposed tokens from {args.path}")
    if not deleted["write_ahead_emptied"]:
        print(f"the write-ahead file {args.path}-wal still holds their old pages (a reader held it); run the purge "
              f"again when the log is idle", file=sys.stderr)
        return 1
    return 0


PURGE_TRIES = 10


def purge(path: str | Path, everything: bool = False, older_than_s: float | None = None,
          requests: tuple[str, ...] = ()) -> dict:
    """Delete requests and their rounds, then empty the write-ahead file -> {"requests": n, "rounds": n,
    "write_ahead_emptied": whether it could be}."""
    import time

    from draftwise.serve.proposal_log import delete_before

    db = connect(Path(path))
    try:
        with db:
            if everything or older_than_s is not None:
                rounds, gone = delete_before(db, float("inf") if everything else time.time() - older_than_s)
            else:
                marks = ", ".join("?" * len(requests))
                rounds = db.execute(f"DELETE FROM rounds WHERE request_id IN ({marks})", requests).rowcount
                gone = db.execute(f"DELETE FROM requests WHERE request_id IN ({marks})", requests).rowcount
        # The old pages leave the write-ahead file too; a reader in the middle of a read (the server's writer, a
        # stats run) holds them a moment: try again a few times.
        for _ in range(PURGE_TRIES):
            busy = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if not busy:
                break
            time.sleep(0.5)
    finally:
        db.close()
    return {"requests": gone, "rounds": rounds, "write_ahead_emptied": not busy}


def log_stats(path: str | Path, spans: int = 8) -> dict:
    db = connect(Path(path))
    try:
        total, accepted, first, last = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(accepted), 0), MIN(id), MAX(id) FROM rounds").fetchone()
        lost = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('dropped', 'requests_dropped')"))
        by_position = [_rate_row({"position": p}, n, a) for p, n, a in db.execute(
            "SELECT position, COUNT(*), SUM(accepted) FROM rounds GROUP BY position ORDER BY position")]
        by_arm = [_rate_row({"method": m, "arm": arm, "rounds": r, "draft_ms_per_round": 1000 * d,
                             "verify_ms_per_round": 1000 * v}, n, a) for m, arm, n, a, r, d, v in db.execute(
            "SELECT method, arm, SUM(n), SUM(a), COUNT(*), AVG(draft_s), AVG(verify_s) FROM "
            "(SELECT method, arm, COUNT(*) AS n, SUM(accepted) AS a, draft_s, verify_s FROM rounds "
            " GROUP BY request_id, step) GROUP BY method, arm ORDER BY method, arm")]
        over_time = []
        if total:
            width = max(1, -(-(last - first + 1) // spans))
            for span, n, a, t0, t1 in db.execute(
                    "SELECT (id - ?) / ?, COUNT(*), SUM(accepted), MIN(ts), MAX(ts) FROM rounds GROUP BY 1 ORDER BY 1",
                    (first, width)):
                over_time.append(_rate_row({"span": span, "from": t0, "to": t1}, n, a))
        requests, fallbacks = db.execute(
            "SELECT COUNT(*), COUNT(fallback) FROM requests").fetchone()
        arms = _by_arm(db)
    finally:
        db.close()
    return {"path": str(path), "proposed": total, "accepted": accepted, "acceptance": _rate(accepted, total),
            "requests_finished": requests, "requests_fallen_back": fallbacks, "rows_dropped": lost.get("dropped", 0),
            "requests_dropped": lost.get("requests_dropped", 0), "by_position": by_position,
            "by_method_and_arm": by_arm, "over_time": over_time, "by_arm": arms}


def _by_arm(db) -> list[dict]:
    """The arms compared, from their finished requests (the requests table holds every one, also an "off"
    arm's, which proposes nothing). Tokens/s is over the requests' decoding time; the time between tokens is
    pooled over every gap (a request's first-to-last token span over its tokens but one)."""
    rows = []
    for arm, methods, n, proposed, accepted, tokens, passes, decode_s, ttft_s, span_s, gaps in db.execute(
            "SELECT arm, GROUP_CONCAT(DISTINCT method), COUNT(*), COALESCE(SUM(proposed), 0), "
            "COALESCE(SUM(accepted), 0), SUM(new_tokens), SUM(passes), SUM(decode_s), AVG(ttft_s), "
            "SUM(CASE WHEN new_tokens > 1 AND ttft_s IS NOT NULL THEN last_token_s - ttft_s END), "
            "SUM(CASE WHEN new_tokens > 1 AND ttft_s IS NOT NULL THEN new_tokens - 1 END) "
            "FROM requests GROUP BY arm ORDER BY arm"):
        row = _rate_row({"arm": arm, "methods": sorted(methods.split(",")), "requests": n}, proposed, accepted)
        row.update(mean_accepted_length=_ratio(tokens, passes), tokens_per_s=_ratio(tokens, decode_s),
                   ttft_ms=_ms(ttft_s), tbt_ms=_ms(span_s, gaps))
        rows.append(row)
    return rows


def _ratio(numerator, denominator) -> float | None:
    """None where either is unknown (NULL: no such requests, or a log from before the column) or it is 0/0."""
    return round(numerator / denominator, 4) if numerator is not None and denominator else None


def _ms(seconds, count=1) -> float | None:
    return round(1000 * seconds / count, 3) if seconds is not None and count else None


def _rate(accepted: int, proposed: int) -> float | None:
    return round(accepted / proposed, 4) if proposed else None


def _rate_row(head: dict, proposed: int, accepted: int) -> dict:
    return {**head, "proposed": proposed, "accepted": accepted, "acceptance": _rate(accepted, proposed)}


def format_stats(stats: dict) -> str:
    def pct(value):
        return "-" if value is None else f"{100 * value:.1f}%"

    def num(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{stats['path']}: {stats['proposed']} proposed tokens, {stats['accepted']} accepted "
             f"({pct(stats['acceptance'])}), {stats['requests_finished']} finished requests "
             f"({stats['requests_fallen_back']} fell back to the target alone), "
             f"{stats['rows_dropped']} rows and {stats['requests_dropped']} requests dropped (the writer fell behind)",
             "", "by draft position (a tree's rounds: its kept path and the first guess after it)",
             "| position | proposed | acceptance |",
             "|---|---|---|"]
    lines += [f"| {r['position']} | {r['proposed']} | {pct(r['acceptance'])} |" for r in stats["by_position"]]
    lines += ["", "by method and arm",
              "| method | arm | rounds | proposed | acceptance | draft ms/round | verify ms/round |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['arm'] or '-'} | {r['rounds']} | {r['proposed']} | {pct(r['acceptance'])} | "
              f"{r['draft_ms_per_round']:.1f} | {r['verify_ms_per_round']:.1f} |" for r in stats["by_method_and_arm"]]
    lines += ["", "by arm (finished requests)",
              "| arm | methods | requests | proposed | acceptance | mean accepted length | tokens/s | TTFT ms | "
              "TBT ms |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['arm'] or '-'} | {', '.join(r['methods'])} | {r['requests']} | {r['proposed']} | "
              f"{pct(r['acceptance'])} | {num(r['mean_accepted_length'], 2)} | {num(r['tokens_per_s'], 1)} | "
              f"{num(r['ttft_ms'], 1)} | {num(r['tbt_ms'], 1)} |" for r in stats["by_arm"]]
    lines += ["", "over time (equal spans of rows; a falling acceptance is drift)",
              "| span | seconds from start | proposed | acceptance |", "|---|---|---|---|"]
    start = stats["over_time"][0]["from"] if stats["over_time"] else 0.0
    lines += [f"| {r['span']} | {r['from'] - start:.0f}-{r['to'] - start:.0f} | {r['proposed']} | "
              f"{pct(r['acceptance'])} |" for r in stats["over_time"]]
    return "\n".join(lines)


def export_pairs(path: str | Path, out) -> int:
    """Write one JSON line per known (context, target token); returns how many."""
    db = connect(Path(path))
    count = 0
    try:
        for request_id, prompt, output in db.execute("SELECT request_id, prompt_ids, output_ids FROM requests"):
            text = json.loads(prompt) + json.loads(output)
            for offset, position, proposed, target, accepted, method, arm in db.execute(
                    "SELECT offset, position, proposed, target, accepted, method, arm FROM rounds "
                    "WHERE request_id = ? AND target IS NOT NULL ORDER BY id", (request_id,)):
                end = offset + position
                if end > len(text):  # the row outlived its text (a request cut short): nothing to pair
                    continue
                out.write(json.dumps({"context": text[:end], "target": target, "proposed": proposed,
                                      "accepted": bool(accepted), "method": method, "arm": arm}) + "\n")
                count += 1
    finally:
        db.close()
    return count
