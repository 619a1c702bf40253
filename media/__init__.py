"""Media codecs the wires share: audio formats (PCM16, G.711, WAV/MP3/Opus/FLAC/AAC
through PyAV, resampling with soxr) and tempo changes. No wire and no session state:
bytes and arrays in, bytes and arrays out."""
