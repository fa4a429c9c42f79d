"""Method cores, apart from Flower: typed settings, local training loops, composable loss terms.

A family's core owns one client round (load state → decode the server's payload → build the loss
terms → train → encode the reply) and reads only its own settings object, never the run config; the
``NumPyClient`` in :mod:`pollen.clients` is a thin adapter around it. Nothing here imports
:mod:`pollen.app` or :mod:`pollen.clients`.
"""
