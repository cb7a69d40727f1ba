"""The doctor's results, shared by the host checks (host) and the pair
test (pair): each check is a dict with a status and a one-line fix."""

import sys

OK, FAIL, WARN, NA = "ok", "fail", "warn", "n/a"
MARK = {OK: "✓", FAIL: "✗", WARN: "!", NA: "-"}


def check(name, status, detail, fix=""):
    return {"check": name, "status": status, "detail": detail, "fix": fix if status != OK else ""}


def print_results(results, out=sys.stdout):
    for r in results:
        print(f"{MARK[r['status']]} {r['check']}: {r['detail']}", file=out)
        if r["fix"]:
            print(f"    fix: {r['fix']}", file=out)
