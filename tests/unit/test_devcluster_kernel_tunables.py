"""The kernel tunables a container node's kubelet sets machine-wide, put back by the last node to
go (devcluster/containernode.py). The functions take the /proc/sys root: here a folder of files
standing in for it (a fake of the kernel's interface), so the test changes nothing on the machine;
the container suite's `down` runs them against the real /proc/sys."""

from __future__ import annotations

import json
from pathlib import Path

from devcluster.containernode import KUBELET_TUNABLES, record_tunables, restore_tunables

MACHINE = {
    "vm/overcommit_memory": "0",
    "vm/panic_on_oom": "0",
    "kernel/panic": "1",
    "kernel/panic_on_oops": "0",
    "kernel/keys/root_maxkeys": "200",
    "kernel/keys/root_maxbytes": "20000",
}
KUBELET = {
    **MACHINE,
    "vm/overcommit_memory": "1",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
}


def write(proc_sys: Path, values: dict[str, str]) -> None:
    for name, value in values.items():
        path = proc_sys / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")


def read(proc_sys: Path) -> dict[str, str]:
    return {name: (proc_sys / name).read_text().strip() for name in KUBELET_TUNABLES}


def test_the_machines_values_come_back_after_the_kubelet_changed_them(tmp_path: Path) -> None:
    proc_sys, record = tmp_path / "sys", tmp_path / "tunables.json"
    write(proc_sys, MACHINE)
    record_tunables(record, proc_sys)
    write(proc_sys, KUBELET)  # the kubelet starts
    record_tunables(record, proc_sys)  # a second node starts: the record keeps the machine's
    assert json.loads(record.read_text()) == MACHINE
    restore_tunables(record, proc_sys)
    assert read(proc_sys) == MACHINE
    assert not record.exists()


def test_without_a_record_nothing_is_written(tmp_path: Path) -> None:
    proc_sys = tmp_path / "sys"
    write(proc_sys, KUBELET)
    restore_tunables(tmp_path / "absent.json", proc_sys)
    assert read(proc_sys) == KUBELET
