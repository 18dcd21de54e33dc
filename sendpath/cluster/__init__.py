"""sendpath on a cluster engine: replicas as a Ray Serve deployment (`serve --ray`).

``fleet.py`` deploys them, ``replica.py`` is one replica inside Serve, ``directory.py``
is where replicas say where they are and how loaded, ``members.py`` keeps a gateway's pool
equal to it, and ``autoscale.py`` is what Serve's autoscaler scales on. Everything here
but ``directory.py``'s and ``members.py``'s plain classes needs the ``ray`` extra.
"""
