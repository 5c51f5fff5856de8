// Internal: Fulgur's launcher for `devices = N` on one node. This process becomes rank 0; ranks
// 1..N-1 are copies of the same program (same executable, arguments and environment) told who
// they are by torchrun's variables, so that the rest of the code cannot tell the two apart.
#pragma once

#include <cstdint>

namespace fulgur::detail {

// Starts the other processes and sets this process's own variables (RANK=0, ...). A child that
// fails ends the run: its rank and exit status are logged, the other children are stopped and,
// if this process does not end by itself within a grace period, it exits non-zero. SIGINT and
// SIGTERM are passed on to the children. At exit, this process waits for its children.
void launch_local_processes(int64_t process_count);

// Tells the launcher that this process's run failed, so that at exit it stops its children
// instead of waiting for them (they could be waiting for rank 0 at a rendezvous).
void note_local_run_failed();
// Tells the launcher that a signal stopped the run on every rank, which all exit with `exit_code`
// (128 + the signal): children that exit so are not failures.
void note_local_run_interrupted(int exit_code);
// Whether note_local_run_failed() was called in this process (launched or not).
bool local_run_failed();

}  // namespace fulgur::detail
