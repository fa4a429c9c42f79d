"""The ``pollen`` command and what it drives: SuperLink, ``flwr run``, Ray (private or an existing
cluster), the process tree, run folders and their lock, ``pollen predict``.

Operations, not the Flower app: the app (:mod:`pollen.app`) never imports this package.
"""
