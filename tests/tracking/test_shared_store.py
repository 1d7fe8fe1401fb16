"""A ``sqlite:`` MLflow store on a network file system is named in one warning line at start-up; a local one (or a
server) is not. The mount table is the text of ``/proc/mounts``."""

from pathlib import Path

from rl_lightning.tracking.mlflow_run import shared_sqlite_store

MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw 0 0
fs1:/export/home /shared nfs4 rw,vers=4.2 0 0
10.0.0.5@tcp:/scratch /shared/lustre lustre rw,flock 0 0
//nas/team /mnt/team\\040drive cifs rw 0 0
"""


def test_a_store_on_a_network_file_system_is_named_once():
    warning = shared_sqlite_store("sqlite:////shared/lustre/runs/mlflow.db", MOUNTS)
    assert warning == (
        "MLflow store /shared/lustre/runs/mlflow.db is on a network file system (lustre at /shared/lustre): SQLite's "
        "locking does not hold there, so concurrent runs writing it can lock each other out or corrupt it; give each "
        "job its own local sqlite file, or run an MLflow server (trainer.logger.init_args.tracking_uri: "
        "http://host:5000)")
    assert "(nfs4 at /shared)" in shared_sqlite_store("sqlite:////shared/me/mlflow.db", MOUNTS)
    assert "(cifs at /mnt/team drive)" in shared_sqlite_store("sqlite:////mnt/team%20drive/m.db", MOUNTS)


def test_local_stores_servers_and_look_alike_paths_are_not():
    for uri in ("sqlite:////tmp/mlflow.db", "sqlite:////sharedx/mlflow.db", "http://127.0.0.1:5000", None,
                "postgresql://u:p@db/mlflow"):
        assert shared_sqlite_store(uri, MOUNTS) is None, uri
    here = Path.cwd()  # the real mount table: the test's working folder is on a local disk
    assert shared_sqlite_store(f"sqlite:///{here}/mlflow.db", Path("/proc/mounts").read_text()) is None
