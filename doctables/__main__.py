"""python -m doctables [--write]: check (or rewrite) the results pages' tables against docs/data."""

from __future__ import annotations

import argparse
import sys

from doctables import load_all
from doctables.core import REPO, Data
from doctables.pages import PAGES, differences, write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m doctables", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite every rebuilt table from its data")
    ap.add_argument("--figures", action="store_true", help="redraw the figures that have data into docs/")
    args = ap.parse_args(argv)
    load_all()
    data = Data()
    if args.figures:
        from doctables.figures import draw_all

        for path in draw_all(data, REPO / "docs"):
            print(f"drew {path.relative_to(REPO)}")
        return 0
    if args.write:
        for page in PAGES:
            print(f"{page.name}: {write(page, data)} table(s) rewritten")
        return 0
    problems = [p for page in PAGES for p in differences(page, data)]
    for p in problems:
        print(p)
    if problems:
        print(f"error: {len(problems)} table(s) differ from docs/data or have no marker "
              "(python -m doctables --write rewrites the rebuilt ones)", file=sys.stderr)
        return 1
    print("every table matches its data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
