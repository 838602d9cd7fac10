"""The read-only web page (``python -m worker ui``): the jobs, a job's progress and loss curve, the
workers and the queue. ``views`` turns records into display strings, ``pages`` into escaped HTML,
``server`` answers GET requests; ``sources`` is where the data comes from."""
