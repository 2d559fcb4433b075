"""The runtime both ends share: the MQTT link, frames on sockets, broker settings and the fleet key file.

``edgefleet.protocol`` says what travels; this package moves it (sockets, paho-mqtt, files).
"""
