"""Keep the MPI-only case file out of plain pytest collection: test_mpi.py runs it under mpiexec."""

collect_ignore = ["mpi_cases.py", "fault_worker.py", "ssh_worker.py", "spawn_worker.py", "launchlib.py"]
