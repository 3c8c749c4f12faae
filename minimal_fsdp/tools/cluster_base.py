"""What the virtual cluster (virtual_cluster.py) and its SLURM (slurm_cluster.py) share, here so
that neither imports the other for it (virtual_cluster imports slurm_cluster for --scheduler
slurm): the package's parent, for the hosts' PYTHONPATH, and the `with` both are used by."""

from pathlib import Path

# this package's parent: a job on the hosts imports the minimal_fsdp that made them
PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


class Started:
    """Something made by up() and removed by down(): `with` makes it, and a failed up() removes what
    it made before the error goes on; leaving the block removes it."""

    def __enter__(self):
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc):
        self.down()
