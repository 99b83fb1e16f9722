"""The pool + manager state machine (kvstrata.testing.stateful) under the active hypothesis profile."""

from hypothesis import settings

from kvstrata.testing.stateful import PoolMachine

TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(settings(), stateful_step_count=40)
