#!/usr/bin/env bash
# Fuzzes the HTTP API with schemathesis, from the OpenAPI document the server itself serves,
# then sends it the attacks of scripts/fuzz_attacks.py (grammars that cost too much, settings
# that would empty auth or exhaust the machine), each of which must fail alone.
#
# Builds a small random model, starts `brigade serve` on it on 127.0.0.1, runs schemathesis
# against /schema/openapi.json with a fixed seed and a bounded number of examples, then checks
# that the server is still healthy and stops cleanly. The bar: 0 server errors (5xx), every
# answer's status, content type and body as the document says. Prints one summary line; the
# exit status is non-zero on any failure (schemathesis's findings are in the log it names).
#
#   scripts/fuzz.sh           every phase (examples, coverage, fuzzing, stateful), 50 examples
#   scripts/fuzz.sh --short   what CI runs: coverage + fuzzing, 10 examples (about a minute)
#
# FUZZ_SEED, FUZZ_EXAMPLES and FUZZ_MAX_TIME (seconds; with it, fuzzing repeats until spent)
# override the defaults; FUZZ_KEEP=1 keeps the work directory (model, config, logs).
set -euo pipefail
cd "$(dirname "$0")/.."

phases=examples,coverage,fuzzing,stateful
examples=50
if [ "${1:-}" = "--short" ]; then
    phases=coverage,fuzzing
    examples=10
elif [ -n "${1:-}" ]; then
    echo "usage: scripts/fuzz.sh [--short]" >&2
    exit 2
fi
examples=${FUZZ_EXAMPLES:-$examples}
seed=${FUZZ_SEED:-1}
checks=not_a_server_error,status_code_conformance,content_type_conformance
checks=$checks,response_schema_conformance,unsupported_method
py=.venv/bin/python
work=$(mktemp -d)
server=""
cleanup() {
    if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then
        kill -KILL "$server" 2>/dev/null || true
    fi
    if [ -z "${FUZZ_KEEP:-}" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
started=$(date +%s)

# A 2-layer random model and a server config on a free port; every request ends quickly.
port=$("$py" - "$work" <<'EOF'
import socket
import sys
from pathlib import Path

from brigade.models.create import create_model

work = Path(sys.argv[1])
model = create_model(work / "tiny", "llama", overrides={"num_hidden_layers": 2})
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
(work / "server.toml").write_text(
    f'[model]\npath = "{model}"\nmax_model_len = 64\n'
    "[kv]\npage_size = 8\nnum_pages = 512\n"
    f'[server]\nhost = "127.0.0.1"\nport = {port}\nserved_model_name = "tiny"\n'
    "shutdown_timeout_s = 5\n"
)
print(port)
EOF
)
base="http://127.0.0.1:$port"
.venv/bin/brigade serve --config "$work/server.toml" >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 240); do
    if ! kill -0 "$server" 2>/dev/null; then
        echo "fuzz: FAILED: the server did not start:" >&2
        cat "$work/server.log" >&2
        exit 1
    fi
    if "$py" -c "import httpx, sys; sys.exit(httpx.get('$base/health').status_code != 200)" \
        2>/dev/null; then
        break
    fi
    sleep 0.5
done

st_args=(run "$base/schema/openapi.json" --checks "$checks" --phases "$phases"
    --max-examples "$examples" --seed "$seed" --workers 2 --request-timeout 60
    --report junit --report-junit-path "$work/junit.xml")
if [ -n "${FUZZ_MAX_TIME:-}" ]; then st_args+=(--max-time "$FUZZ_MAX_TIME"); fi
st_status=0
# From the work directory: schemathesis keeps its example database in ./.schemathesis.
st=$PWD/.venv/bin/st
(cd "$work" && "$st" "${st_args[@]}" >schemathesis.log 2>&1) || st_status=$?

# The attacks of the issue "One small request must never stop the server" (grammars that
# cost too much, settings that would empty auth or exhaust the machine): each fails alone.
attacks_status=0
"$py" scripts/fuzz_attacks.py "$base" "$work" "$server" >"$work/attacks.log" 2>&1 \
    || attacks_status=$?

healthy=$("$py" -c "import httpx; print(httpx.get('$base/health').status_code)" 2>/dev/null \
    || echo "down")
kill -TERM "$server"
server_status=0
wait "$server" || server_status=$?
server=""

summary=$("$py" - "$work" "$st_status" "$healthy" "$server_status" "$attacks_status" <<'EOF'
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

work, st_status, healthy, server_status, attacks_status = Path(sys.argv[1]), *sys.argv[2:]
log = (work / "schemathesis.log").read_text(errors="replace")
cases = re.search(r"(\d+) generated", log)
operations = failures = "?"
if (work / "junit.xml").is_file():
    suite = ElementTree.parse(work / "junit.xml").getroot()
    operations = suite.get("tests", "?")
    failures = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
server_log = (work / "server.log").read_text(errors="replace")
server_errors = len(re.findall(r"unhandled error|stream_failed|Traceback", server_log))
attacks = (work / "attacks.log").read_text(errors="replace").splitlines()
attacks_ok = sum(line.endswith(": ok") for line in attacks)
print(
    f"{cases[1] if cases else '?'} cases over {operations} operations, {failures} failures, "
    f"{attacks_ok} of {len(attacks)} attacks held, {server_errors} server errors logged, "
    f"/health {healthy} after, server exit {server_status}"
)
ok = st_status == "0" and failures == 0 and server_errors == 0 and attacks_status == "0"
ok = ok and healthy == "200" and server_status == "0"
sys.exit(0 if ok else 1)
EOF
) && verdict=ok || verdict=FAILED
elapsed=$(($(date +%s) - started))
echo "fuzz: $verdict: $summary, ${elapsed} s (seed $seed, $phases, $examples examples)"
if [ "$verdict" != ok ]; then
    FUZZ_KEEP=1
    echo "fuzz: schemathesis's report: $work/schemathesis.log; the attacks': $work/attacks.log;" \
        "the server's: $work/server.log" >&2
    exit 1
fi
