# Sourced by the tests that throttle a rank's CPU (multihost.sh, net_faults.sh): a CPU quota
# in a cgroup of its own, with cgroup v1's CPU controller (cpu.cfs_quota_us) where it is
# mounted, else cgroup v2's (cpu.max). Expects $id (a name unique to the run).
#   quota_make PERCENT   makes the cgroup, quota PERCENT of one CPU; returns 1 with the reason
#                        in $quota_why where neither can be had here
#   quota_add PID...     moves the processes (all their threads) into it
#   quota_lift           lifts the quota (the processes stay: nothing else to move)
#   quota_remove         moves what is left back to the parent and removes the cgroup
quota_period=100000
quota_dir=""; quota_kind=""; quota_why=""
quota_make() {
  local pct="$1" v1=/sys/fs/cgroup/cpu v2=/sys/fs/cgroup
  local quota=$((quota_period * pct / 100))
  if [ -f "$v1/cpu.cfs_quota_us" ]; then
    mkdir "$v1/$id" 2> /dev/null || { quota_why="cgroup v1: cannot make $v1/$id (no privilege?)"; return 1; }
    quota_dir="$v1/$id"; quota_kind="cgroup v1"
    echo "$quota_period" > "$quota_dir/cpu.cfs_period_us" && echo "$quota" > "$quota_dir/cpu.cfs_quota_us" ||
      { quota_why="cgroup v1: cannot set the quota in $quota_dir"; return 1; }
    return 0
  fi
  if [ -f "$v2/cgroup.controllers" ]; then
    # cgroup v2: the CPU controller must be enabled for the children of the root (where a
    # container's root holds processes of its own, the kernel refuses that: said below).
    grep -qw cpu "$v2/cgroup.controllers" || { quota_why="cgroup v2 without the cpu controller"; return 1; }
    if ! grep -qw cpu "$v2/cgroup.subtree_control"; then
      echo +cpu > "$v2/cgroup.subtree_control" 2> /dev/null ||
        { quota_why="cgroup v2: cannot enable the cpu controller in $v2/cgroup.subtree_control"; return 1; }
    fi
    mkdir "$v2/$id" 2> /dev/null || { quota_why="cgroup v2: cannot make $v2/$id (no privilege?)"; return 1; }
    quota_dir="$v2/$id"; quota_kind="cgroup v2"
    echo "$quota $quota_period" > "$quota_dir/cpu.max" || { quota_why="cgroup v2: cannot write $quota_dir/cpu.max"; return 1; }
    return 0
  fi
  quota_why="neither cgroup v1's CPU controller ($v1) nor cgroup v2 ($v2/cgroup.controllers) is mounted"
  return 1
}
quota_add() {
  local pid
  for pid in "$@"; do echo "$pid" > "$quota_dir/cgroup.procs" || return 1; done
}
quota_lift() {
  if [ "$quota_kind" = "cgroup v1" ]; then echo -1 > "$quota_dir/cpu.cfs_quota_us"
  else echo "max $quota_period" > "$quota_dir/cpu.max"; fi
}
quota_remove() {
  [ -n "$quota_dir" ] && [ -d "$quota_dir" ] || return 0
  local pid parent
  parent=$(dirname "$quota_dir")
  for pid in $(cat "$quota_dir/cgroup.procs" 2> /dev/null); do echo "$pid" > "$parent/cgroup.procs" 2> /dev/null; done
  rmdir "$quota_dir" 2> /dev/null
}
