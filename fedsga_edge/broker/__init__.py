"""The MQTT broker a field run or a trial talks through: starting one, and configuring Mosquitto.

Not a role and not the core: whoever runs a broker uses it (``fedsga-edge trial`` starts one,
``fedsga-edge broker-config`` writes a field run's logins, ACL and TLS for Mosquitto, tests and
benchmarks start their own). It imports no torch and no role: a broker host installs the base
package only.

- ``launch``: the embedded broker (rumqttd from ``iotcore``) and Mosquitto as child processes on
  127.0.0.1 (``start_embedded``, ``start_mosquitto``, ``RunningBroker``), and reachability checks.
- ``config``: Mosquitto's ``mosquitto.conf``, ``acl``, ``passwd`` and per-login credentials
  (``write_broker_config``); ``deploy/`` holds an example of what it writes.
"""
