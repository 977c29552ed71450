"""The worker side: what runs in a Celery worker for threaded tasks.

* :mod:`.bootstep`: the worker bootstep, which starts and stops the rest with the worker;
* :mod:`.strategy`: receipt of a delivery (the task's strategy), and messages no worker can run;
* :mod:`.request`: the main process's endings of what its pool processes ran (the request class);
* :mod:`.revoke`: Celery's revoke command and ``task_revoked`` for threaded members;
* :mod:`.processes`: which pool process a request went to, and acting once one has exited;
* :mod:`.renewer`: release deadlines of the members a worker holds unstarted;
* :mod:`.member`: a member's run in a pool process: its claim, its body under the lease, its ending;
* :mod:`.lease`: leases of running members, their renewal and the watchdog that stops a pool
  process before its member's lease ends;
* :mod:`.shared`: the memory the worker's main process shares with its pool processes;
* :mod:`.handoff`: a pool process running the next member its own ``finish`` released;
* :mod:`.noack`: deliveries kept out of the broker's acknowledgement bookkeeping;
* :mod:`.native`: OS threads for the lease keeper under gevent.

It imports the layers below it (the gate, publishing, the runtime, the dispatcher) and nothing above
(the task class, the wiring, the admin API, the CLI).
"""
