"""Turn the summary JSONs of run.sh (base, K=1, K=3) into one Markdown table.

usage: python table.py BASE.json [K1.json [K3.json]] [--labels base,K=1,K=3] [--pending] [--all]

A column whose file is missing (or named "-") reads "pending". Rows: every test; by default tests that are
skipped in every column that ran are folded into the "skipped everywhere" list below the table (--all keeps them).
Reasons: the failure (or skip) reason of each column where the outcome differs from "passed".
"""

import argparse
import collections
import json
import os
import subprocess

SHORT = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip"}


def load(path):
    if not path or path == "-" or not os.path.isfile(path):
        return None
    return json.load(open(path))


def cell_reason(text: str, limit: int = 140) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def provenance() -> list[str]:
    """The command that makes the table and tadm's commit (with a note when the tree has uncommitted changes)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " (uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return ["", "- Command: `SUITE=path/to/suite SITE=path/to/site OUT=results bash benchmarks/transformers_suite/run.sh` "
            "(its last step, `table.py`, writes this table)", f"- Commit: tadm `{commit}`{dirty}"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--labels", default="base,K=1,K=3")
    ap.add_argument("--all", action="store_true", help="list tests skipped in every column too")
    ap.add_argument("--classification", help="classification.json: adds a column with what each test compares")
    args = ap.parse_args()
    labels = args.labels.split(",")
    files = (args.files + ["-"] * len(labels))[: len(labels)]
    runs = [load(f) for f in files]
    kinds = json.load(open(args.classification))["tests"] if args.classification else None
    keys = sorted({k for r in runs if r for k in r["tests"]}, key=lambda k: (k.split("::")[0], k.split("::")[1], k))

    out = []
    head = ["| column | class | K | transformers | tests | passed | failed | error | skipped |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, run in zip(labels, runs):
        if run is None:
            head.append(f"| {label} | pending | | | | | | | |")
            continue
        c = collections.Counter(t["outcome"] for t in run["tests"].values())
        head.append(f"| {label} | `{run['class']}` | {run['k']} | {run['transformers']} | {len(run['tests'])} | "
                    f"{c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |")
    out += head + [""]

    extra = " compares | builds the class |" if kinds else ""
    out.append("| test |" + extra + " " + " | ".join(labels) + " | reason (where not passed) |")
    out.append("|---|" + ("---|---|" if kinds else "") + "---|" * len(labels) + "---|")
    folded = collections.defaultdict(list)
    for key in keys:
        outcomes = []
        reasons = []
        for label, run in zip(labels, runs):
            if run is None:
                outcomes.append("pending")
                continue
            entry = run["tests"].get(key)
            if entry is None:
                outcomes.append("—")
                continue
            outcomes.append(SHORT.get(entry["outcome"], entry["outcome"]))
            if entry["outcome"] != "passed":
                reasons.append((label, entry["reason"]))
        present = [o for o in outcomes if o not in ("pending", "—")]
        if not args.all and present and all(o == "skip" for o in present):
            folded[reasons[0][1] if reasons else ""].append(key.split("::")[-1])
            continue
        distinct = {r for _, r in reasons}
        if len(distinct) == 1 and len(reasons) > 1:
            reason_text = cell_reason(reasons[0][1])
        else:
            reason_text = "; ".join(f"{label}: {cell_reason(r)}" for label, r in reasons)
        name = key.split("::")[-1]
        cls = key.split("::")[1] if key.count("::") >= 2 else ""
        short_cls = {"DiffusionGemmaVisionText2TextModelTest": "", "DiffusionGemmaGenerationClassesTester": "gen: ",
                     "DiffusionGemmaIntegrationTest": "integration: "}.get(cls, cls + ": ")
        info = kinds.get(key, {}) if kinds else {}
        built = "yes" if info.get("uses_block_diffusion_class") else "no"
        kind = f" {info.get('compares', '?')} | {built} |" if kinds else ""
        out.append(f"| {short_cls}`{name}` |{kind} " + " | ".join(outcomes) + f" | {reason_text} |")
    if folded:
        out += ["", f"Skipped in every column that ran ({sum(len(v) for v in folded.values())} tests), by reason:", ""]
        for reason, names in sorted(folded.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            out.append(f"- {cell_reason(reason, 200)} ({len(names)}): " + ", ".join(f"`{n}`" for n in names))
    print("\n".join(out + provenance()))


if __name__ == "__main__":
    main()
