#!/usr/bin/env python3
"""Every flag of the three programs is documented in the serving guide.

Reads the flags from the built binaries (`--helpfull` of logprob-server and
logprob-worker: the flags of their own main.cc, or logprob-server's
server/app/server_flags.cc; `--help` of logprob-client)
and checks that each appears, spelled with dashes (`--max-queue-delay`),
in docs/serving.md. Exits 1 naming the missing ones (ctest docs_flags).

    check_flags.py --bin-dir build/bin --doc docs/serving.md
"""

import argparse
import os
import re
import subprocess
import sys


def absl_flags(binary):
    """The flags of the program's own main.cc (or server_flags.cc) in `--helpfull`."""
    out = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    flags, mine = set(), False
    for line in text.splitlines():
        if line.strip().startswith("Flags from "):
            mine = line.strip().endswith(("/main.cc:", "/server_flags.cc:"))
            continue
        m = re.match(r"^\s{4}--([a-z0-9_]+) ", line)
        if mine and m:
            flags.add(m.group(1).replace("_", "-"))
    return flags


def usage_flags(binary):
    """The flags named in the program's usage text."""
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    return {m.group(1) for m in re.finditer(r"(?<![\w-])--([a-z][a-z0-9-]*[a-z0-9])", out.stdout + out.stderr)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--doc", required=True)
    args = parser.parse_args()
    with open(args.doc) as f:
        doc = f.read()
    documented = set(re.findall(r"--([a-z][a-z0-9-]*[a-z0-9])", doc))
    missing = []
    for program, read in (("logprob-server", absl_flags), ("logprob-worker", absl_flags),
                          ("logprob-client", usage_flags)):
        flags = read(os.path.join(args.bin_dir, program))
        if len(flags) < 5:
            print("%s: found only %d flags in its help: cannot check" % (program, len(flags)), file=sys.stderr)
            return 1
        gone = sorted(flags - documented)
        missing += ["%s --%s" % (program, f) for f in gone]
        print("%s: %d flags, %d documented in %s" % (program, len(flags), len(flags) - len(gone), args.doc))
    if missing:
        print("not documented in %s:\n  %s" % (args.doc, "\n  ".join(missing)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
