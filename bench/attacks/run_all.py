"""
Run every attack in bench/attacks/ against Dallal (and, with --peers,
those that have an equivalent against Mosquitto, NATS and Redis), one
after the other, and print a summary of their verdicts.

    python3 bench/attacks/run_all.py [--peers] [--only NAME ...]

Exit status 0 if every Dallal attack passed, 1 otherwise.
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Script, and the peers it can attack the same way.
ATTACKS = [
    ("udp_hijack.py", ()),
    ("bridge_forgery.py", ()),
    ("login_flood.py", ("dallal-mqtt",)),
    ("output_bound.py", ("dallal-mqtt", "mosquitto", "nats", "redis")),
    ("fanout_freeze.py", ("mosquitto",)),
    ("garbage_stream.py", ("mosquitto", "nats", "redis")),
    ("slowloris.py", ("dallal-mqtt", "mosquitto", "nats", "redis")),
    ("udp_answer_cache.py", ()),
    ("retained_flood.py", ()),
    ("traceback_fuzz.py", ()),
    ("empty_store.py", ()),
    # Beyond the list.
    ("subscribe_storm.py", ("mosquitto",)),
    ("topics_scan.py", ()),
    ("udp_lockout.py", ()),
    ("acl_clientid.py", ()),
    ("udp_garbage.py", ()),
    # MQTT (--mqtt).
    ("mqtt_session_hijack.py", ()),
    ("mqtt_qos2_hoard.py", ("mosquitto",)),
    ("mqtt_offline_queues.py", ("mosquitto",)),
    ("mqtt_fuzz.py", ("mosquitto",)),
    ("mqtt_websocket_flood.py", ()),
    ("mqtt_overlap.py", ("mosquitto",)),
    ("mqtt_half_connect.py", ("mosquitto",)),
    ("mqtt_takeover.py", ("mosquitto",)),
]
TIMEOUT = 300


def run(script, broker):
    """
    Run one attack; return (its verdict line, seconds it took).
    """
    command = [sys.executable, os.path.join(HERE, script)]
    if broker != "dallal":
        command += ["--broker", broker]
    start = time.monotonic()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
        output = completed.stdout + completed.stderr
        lines = [
            line for line in output.splitlines() if line.startswith(("PASS ", "FAIL ", "ERROR "))
        ]
        verdict = (
            lines[-1]
            if lines
            else f"ERROR {script}: no verdict (exit {completed.returncode}): {output.strip()[-300:]}"
        )
    except subprocess.TimeoutExpired:
        verdict = f"ERROR {script}: no verdict within {TIMEOUT} s"
    return verdict, time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument(
        "--peers", action="store_true", help="also attack Mosquitto, NATS and Redis"
    )
    parser.add_argument("--only", nargs="*", help="attack scripts to run (e.g. udp_hijack)")
    options = parser.parse_args()
    chosen = [
        (script, peers)
        for script, peers in ATTACKS
        if not options.only or script.removesuffix(".py") in options.only or script in options.only
    ]
    results = []
    for script, peers in chosen:
        # Dallal's other listeners (dallal-mqtt) always; the peers with --peers.
        ours = [broker for broker in peers if broker.startswith("dallal")]
        others = [broker for broker in peers if broker not in ours] if options.peers else []
        for broker in ("dallal", *ours, *others):
            verdict, seconds = run(script, broker)
            print(f"[{seconds:5.1f} s] {verdict}", flush=True)
            results.append((script, broker, verdict.split(" ", 1)[0]))
    print("\nSummary")
    print(f"{'attack':<22} {'broker':<10} verdict")
    for script, broker, word in results:
        print(f"{script.removesuffix('.py'):<22} {broker:<10} {word}")
    dallalFailed = [
        script for script, broker, word in results if broker.startswith("dallal") and word != "PASS"
    ]
    print(
        f"\nDallal: {sum(1 for _, b, w in results if b.startswith('dallal') and w == 'PASS')} passed, "
        f"{len(dallalFailed)} not passed"
    )
    sys.exit(1 if dallalFailed else 0)


if __name__ == "__main__":
    main()
