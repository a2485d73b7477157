"""Multi-process runs, one concept a module.

- :mod:`k3jax.runtime.startup`: where a process sits in the run
  (:class:`~k3jax.runtime.startup.ProcessSpec`), read from flags or the
  environment, the timeouts, and joining the run.
- :mod:`k3jax.runtime.rendezvous`: every process meeting on the
  coordinator's port before jax joins them, saying whom it waits for.
- :mod:`k3jax.runtime.agreement`: what every process must agree on before
  any device work (flags, files, inputs), and moving host arrays onto and off
  a mesh that spans the processes.
- :mod:`k3jax.runtime.supervision`: the supervisor that runs the work in a
  child Python and turns XLA's abort on a lost peer into one clear line.
"""
