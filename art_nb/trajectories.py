"""`art_nb.trajectories`, ART's module name for what art_nb keeps in `art_nb.trajectory`."""

from .trajectory import History, RolloutException, Trajectory, TrajectoryGroup

__all__ = ["History", "RolloutException", "Trajectory", "TrajectoryGroup"]
