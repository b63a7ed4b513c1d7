"""The command lines (`clusterctl <command>` and the fab tasks' front ends): parse arguments, call one
backend or operation, render the result with rich. Nothing below this layer prints or exits
(docs/architecture.md §1); cli.py loads each module here only for its own commands."""
