"""The worker side: what runs in a Celery worker for threaded tasks.

* :mod:`.step`: the worker bootstep, the request class and strategy, revoke and unrunnable messages;
* :mod:`.member`: a member's run in a pool process: its claim, its body under the lease, its ending;
* :mod:`.lease`: leases of running members, their renewal and the watchdog that stops a pool
  process before its member's lease ends;
* :mod:`.handoff`: a pool process running the next member its own ``finish`` released;
* :mod:`.noack`: deliveries kept out of the broker's acknowledgement bookkeeping;
* :mod:`.native`: OS threads for the lease keeper under gevent.

It imports the layers below it (the gate, publishing, the runtime, the dispatcher) and nothing above
(the task class, the wiring, the admin API, the CLI).
"""
