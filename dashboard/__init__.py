"""``batchery dashboard``: a web page of queues, workers, dead letters and offline jobs
(the ``dashboard`` extra: ``pip install 'batchery[dashboard]'``)."""
