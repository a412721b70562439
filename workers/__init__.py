"""The hybrid-model engine a worker replica runs: model, caches, scheduler, runner."""
