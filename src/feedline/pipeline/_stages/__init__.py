"""Stage runtimes: what runs each kind of stage while a pipeline is running.

* ``_common``   failure accounting and the interface stages see of the running pipeline
* ``_threaded`` sync ops, sync sources, aggregate/disaggregate: drain jobs in a thread pool
* ``_async``    coroutine / async-generator ops, async sources, ops sent to process pools
* ``_sink``     the consumer's end: a blocking get for the user's thread
"""
