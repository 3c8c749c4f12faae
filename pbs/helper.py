"""What pbs/common.sh asks Python for (the standard library only: it runs before anything else is
known to work, in a fraction of a second). Words come out NUL-terminated, for `mapfile -d ''`.

    helper.py words TEXT       TEXT split as a shell splits words: quotes group, a backslash
                               escapes, nothing is expanded (ARGS)
    helper.py words-file PATH  the same for a file's text, # comments dropped (ARGS_FILE)
    helper.py walltime         qstat -f -F json on stdin -> the job's walltime (HH:MM:SS)
    helper.py successor        qstat -f -F json on stdin -> the qsub options that repeat this job
                               (-A, -l select/place/walltime/filesystems, -r), "--", then
                               NAME=VALUE for every setting of its Variable_List but PBS's own
                               (PBS_O_*)

Bad input is one `error:` line and exit 2.
"""

import json
import shlex
import sys

# the resources a successor asks for again (the others are PBS's, derived from these)
RESOURCES = ("select", "place", "walltime", "filesystems")


def words(text, what):
    try:
        return shlex.split(text, comments=what == "ARGS_FILE")
    except ValueError as e:  # "No closing quotation", "No escaped character"
        sys.exit(f"error: {what}: {e} in {text!r}: quote as in a shell, e.g. --prompt 'ROMEO: Hi'")


def job(stdin):
    # strict=False: PBS writes some control characters raw inside the JSON strings
    jobs = json.loads(stdin, strict=False)["Jobs"]
    return next(iter(jobs.values()))


def emit(items):
    sys.stdout.write("".join(f"{item}\0" for item in items))


def main(argv):
    command = argv[0] if argv else ""
    if command == "words" and len(argv) == 2:
        emit(words(argv[1], "ARGS"))
    elif command == "words-file" and len(argv) == 2:
        try:
            with open(argv[1]) as f:
                text = f.read()
        except OSError as e:
            sys.exit(f"error: ARGS_FILE={argv[1]}: {e.strerror}: name a readable file of flags")
        emit(words(text, "ARGS_FILE"))
    elif command == "walltime":
        print(job(sys.stdin.read()).get("Resource_List", {}).get("walltime", ""))
    elif command == "successor":
        this = job(sys.stdin.read())
        options = []
        if this.get("Account_Name"):
            options += ["-A", this["Account_Name"]]
        resources = this.get("Resource_List", {})
        for name in RESOURCES:
            if name in resources:
                options += ["-l", f"{name}={resources[name]}"]
        if "Rerunable" in this:
            options += ["-r", "y" if str(this["Rerunable"]).lower() == "true" else "n"]
        settings = [
            f"{name}={value}"
            for name, value in this.get("Variable_List", {}).items()
            if not name.startswith("PBS_O_")
        ]
        emit([*options, "--", *settings])
    else:
        sys.exit("error: pbs/helper.py: unknown command (see its docstring)")


if __name__ == "__main__":
    main(sys.argv[1:])
