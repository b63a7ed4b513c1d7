"""A test job whose behaviour is chosen by env vars, so one script covers every lifecycle test.

pservers listen on their planned endpoint until stopped. Trainers print `step=N` lines, then exit
0 after $STEPS steps; trainer $FAIL_TRAINER exits $FAIL_CODE after $FAIL_AFTER steps. $SETSID_CHILD=1 makes the
trainer start a grandchild in a new session that ignores SIGTERM (the escape GUIDE §3 names).
"""

import os
import signal
import socket
import subprocess
import sys
import time

role = os.environ["TRAINING_ROLE"]
me = int(os.environ.get("PADDLE_TRAINER_ID") or os.environ.get("PADDLE_PSERVER_ID"))
print(f"{role.lower()} {me} argv={sys.argv[1:]} endpoint={os.environ['PADDLE_CURRENT_ENDPOINT']}", flush=True)
if os.environ.get("CLUSTERCTL_RESTART_COUNT", "0") != "0":  # a restart (job.restarts): say which attempt
    print(f"attempt={os.environ['CLUSTERCTL_RESTART_COUNT']} torchelastic={os.environ['TORCHELASTIC_RESTART_COUNT']}",
          flush=True)

if os.environ.get("SETSID_CHILD") == "1" and role == "TRAINER":
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

if role == "PSERVER":
    ip, port = os.environ["PADDLE_CURRENT_ENDPOINT"].rsplit(":", 1)
    srv = socket.socket()
    srv.bind((ip, int(port)))
    srv.listen()
    print("pserver listening", flush=True)
    while True:
        time.sleep(1)

steps = int(os.environ.get("STEPS", "5"))
failing = os.environ.get("FAIL_TRAINER") == str(me)
for step in range(steps):
    if failing and step == int(os.environ.get("FAIL_AFTER", "2")):
        print("failing on purpose", flush=True)
        sys.exit(int(os.environ.get("FAIL_CODE", "1")))
    print(f"step={step} trainer={me}", flush=True)
    time.sleep(float(os.environ.get("STEP_S", "0.2")))
sys.exit(0)
