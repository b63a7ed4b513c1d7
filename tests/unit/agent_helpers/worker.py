"""Stand-in training process for tests/unit/test_agent.py.

usage: worker.py sleep                 run until signalled
       worker.py exit CODE DELAY       sleep DELAY seconds, exit with CODE
       worker.py serve HOST PORT       listen on HOST:PORT until signalled (a pserver)
       worker.py threads N MIB         N threads and MIB MiB of touched memory until signalled (a pserver's
                                       shape: its exit takes a while after its main thread is gone)
       worker.py attempts N CODE DELAY print the attempt number, sleep DELAY seconds, exit with CODE
                                       while the attempt (CLUSTERCTL_RESTART_COUNT) is below N, else 0
       worker.py escape PIDFILE        fork a child that setsid()s, ignores SIGTERM and
                                       writes its pid to PIDFILE; both sleep forever
"""
import os
import signal
import socket
import sys
import time


def forever():
    while True:
        time.sleep(3600)


def main(argv):
    mode = argv[1]
    if mode == "sleep":
        forever()
    elif mode == "exit":
        time.sleep(float(argv[3]))
        sys.exit(int(argv[2]))
    elif mode == "attempts":
        attempt = int(os.environ["CLUSTERCTL_RESTART_COUNT"])
        print("attempt=%d torchelastic=%s" % (attempt, os.environ["TORCHELASTIC_RESTART_COUNT"]), flush=True)
        time.sleep(float(argv[4]))
        sys.exit(int(argv[3]) if attempt < int(argv[2]) else 0)
    elif mode == "threads":
        import threading

        held = bytearray(int(argv[3]) << 20)
        for i in range(0, len(held), 4096):
            held[i] = 1
        for _ in range(int(argv[2])):
            threading.Thread(target=forever, daemon=True).start()
        print("ready", flush=True)
        forever()
    elif mode == "serve":
        srv = socket.create_server((argv[2], int(argv[3])))
        while True:
            conn, _ = srv.accept()
            conn.close()
    elif mode == "escape":
        pid = os.fork()
        if pid == 0:
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            tmp = argv[2] + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.replace(tmp, argv[2])
            forever()
        forever()
    else:
        sys.exit("unknown mode %r" % mode)


if __name__ == "__main__":
    main(sys.argv)
