#!/usr/bin/env node
// Publish one Celery task (protocol v2) through celery-redis-lua's publish script.
//
//   node publish.js --url redis://127.0.0.1:6379/0 --queue celery --task proj.tasks.add \
//       --args '[1,2]' --priority 5 --countdown 3 [--dedup-id report:42 --dedup simple]
//
// prints the task id; with a dedup id held in the queue, says on stderr which message holds
// it (nothing stored), or which waiting message a debounce replaced. The script is lua/publish.lua of the repository (or --script /
// $CRL_PUBLISH_LUA); it is called with EVALSHA, and loaded once on NOSCRIPT. Its header
// is the contract: KEYS queue, delayed, messages_index, meta, dead, message, state, wake of
// the queue (every queue script takes these eight); ARGV payload, priority, eta_ms, ttl_ms,
// visibility_ms, task_id, and for deduplication exchange and routed_ms ('' here), dedup_id,
// dedup_mode (simple, throttle, debounce) and dedup_ttl_ms ('' for until the holder goes).
'use strict';

const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { parseArgs } = require('node:util');
const { createClient } = require('redis');

const USAGE = `usage: node publish.js --task NAME [--url URL] [--queue celery] [--args JSON-array]
       [--kwargs JSON-object] [--priority 0..255] [--countdown SECONDS] [--id TASK_ID]
       [--prefix GLOBAL_KEYPREFIX] [--visibility-ms 300000] [--script PATH/publish.lua]
       [--dedup-id ID [--dedup simple|throttle|debounce] [--dedup-ttl-ms MS]]`;

function fail(message) {
  process.stderr.write(`publish.js: ${message}\n`);
  process.exit(1);
}

function options() {
  let parsed;
  try {
    parsed = parseArgs({
      options: {
        url: { type: 'string', default: process.env.CELERY_BROKER_URL || 'redis://127.0.0.1:6379/0' },
        queue: { type: 'string', default: 'celery' },
        task: { type: 'string' },
        args: { type: 'string', default: '[]' },
        kwargs: { type: 'string', default: '{}' },
        priority: { type: 'string', default: '0' },
        countdown: { type: 'string', default: '0' },
        id: { type: 'string' },
        prefix: { type: 'string', default: '' },
        'visibility-ms': { type: 'string', default: '300000' },
        'dedup-id': { type: 'string' },
        dedup: { type: 'string', default: 'simple' },
        'dedup-ttl-ms': { type: 'string', default: '' },
        script: {
          type: 'string',
          default: process.env.CRL_PUBLISH_LUA || path.join(__dirname, '..', '..', 'lua', 'publish.lua'),
        },
        help: { type: 'boolean', default: false },
      },
    }).values;
  } catch (error) {
    fail(`${error.message}\n${USAGE}`);
  }
  if (parsed.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  if (!parsed.task) fail(`--task is required\n${USAGE}`);
  const json = (name, check, what) => {
    let value;
    try {
      value = JSON.parse(parsed[name]);
    } catch (error) {
      fail(`--${name} is not JSON: ${error.message}`);
    }
    if (!check(value)) fail(`--${name} must be a JSON ${what}`);
    return value;
  };
  const args = json('args', Array.isArray, 'array');
  const kwargs = json('kwargs', (v) => v !== null && typeof v === 'object' && !Array.isArray(v), 'object');
  const priority = Number(parsed.priority);
  if (!/^\d+$/.test(parsed.priority) || priority > 255) fail('--priority must be an integer in 0..255');
  const countdown = Number(parsed.countdown);
  if (!Number.isFinite(countdown) || countdown < 0) fail('--countdown must be a number of seconds >= 0');
  if (!/^[1-9]\d*$/.test(parsed['visibility-ms'])) fail('--visibility-ms must be a positive integer');
  if (/[{}]/.test(parsed.queue) || parsed.queue === '') fail('--queue must be non-empty, without { or }');
  // Celery's own scheme for this transport is redislua://; node-redis speaks redis://.
  const url = parsed.url.replace(/^redislua(s?):\/\//, 'redis$1://');
  return { ...parsed, url, args, kwargs, priority, countdown, id: parsed.id || crypto.randomUUID() };
}

// The Celery protocol v2 message as kombu stores it: headers, properties, base64 body.
function envelope(opts, etaMs) {
  const body = [opts.args, opts.kwargs, { callbacks: null, errbacks: null, chain: null, chord: null }];
  const eta = etaMs ? new Date(etaMs).toISOString().replace('Z', '+00:00') : null;
  return {
    body: Buffer.from(JSON.stringify(body), 'utf8').toString('base64'),
    'content-encoding': 'utf-8',
    'content-type': 'application/json',
    headers: {
      lang: 'py', // the language the task is implemented in (the worker's), as Celery sends it
      task: opts.task,
      id: opts.id,
      shadow: null,
      eta,
      expires: null,
      group: null,
      group_index: null,
      retries: 0,
      timelimit: [null, null],
      root_id: opts.id,
      parent_id: null,
      argsrepr: JSON.stringify(opts.args),
      kwargsrepr: JSON.stringify(opts.kwargs),
      origin: `node-${process.pid}@${os.hostname()}`,
      ignore_result: false,
      replaced_task_nesting: 0,
      stamped_headers: null,
      stamps: {},
    },
    properties: {
      correlation_id: opts.id,
      reply_to: '',
      delivery_mode: 2,
      delivery_info: { exchange: '', routing_key: opts.queue },
      priority: opts.priority,
      body_encoding: 'base64',
      delivery_tag: crypto.randomUUID(),
    },
  };
}

// EVALSHA with the file's SHA1; on NOSCRIPT (a fresh, restarted or flushed server) load
// the exact bytes once and retry.
async function evalScript(client, source, sha, keys, argv) {
  const command = ['EVALSHA', sha, String(keys.length), ...keys, ...argv];
  try {
    return await client.sendCommand(command);
  } catch (error) {
    if (!String(error.message).startsWith('NOSCRIPT')) throw error;
    const loaded = await client.sendCommand(['SCRIPT', 'LOAD', source]);
    if (loaded !== sha) throw new Error(`SCRIPT LOAD returned ${loaded}, expected ${sha}`);
    return client.sendCommand(command);
  }
}

async function main() {
  const opts = options();
  let source;
  try {
    source = fs.readFileSync(opts.script, 'utf8');
  } catch (error) {
    fail(`cannot read the publish script: ${error.message}`);
  }
  const sha = crypto.createHash('sha1').update(source, 'utf8').digest('hex');
  const client = createClient({ url: opts.url, socket: { connectTimeout: 5000, reconnectStrategy: false } });
  client.on('error', () => {}); // a failed command or connect rejects its promise; report that once
  try {
    await client.connect();
    // The ETA is judged by the server's clock (the scripts read TIME), so compute it from TIME.
    let etaMs = 0;
    if (opts.countdown > 0) {
      const [seconds, micros] = await client.sendCommand(['TIME']);
      etaMs = Number(seconds) * 1000 + Math.floor(Number(micros) / 1000) + Math.round(opts.countdown * 1000);
    }
    const tag = `{${opts.queue}}`;
    const keys = ['queue:', 'delayed:', 'messages_index:', 'meta:', 'dead:', 'message:', 'state:', 'wake:']
      .map((k) => opts.prefix + k + tag);
    const payload = JSON.stringify(envelope(opts, etaMs));
    const argv = [
      payload, String(opts.priority), etaMs ? String(etaMs) : '', '', opts['visibility-ms'],
      opts.id, // the task id: indexed, so `celery-redis-lua where` and `cancel` find the message
    ];
    if (opts['dedup-id'] !== undefined) { // the script checks the mode and the ttl, and names a bad one
      argv.push('', '', opts['dedup-id'], opts.dedup, opts['dedup-ttl-ms']);
    }
    const reply = await evalScript(client, source, sha, keys, argv);
    process.stdout.write(`${opts.id}\n`);
    if (Array.isArray(reply) && reply[0] === 'deduplicated') {
      process.stderr.write(`publish.js: not stored: message ${reply[1]} holds dedup id ${opts['dedup-id']}\n`);
    } else if (Array.isArray(reply) && reply[0] === 'replaced') {
      process.stderr.write(`publish.js: replaced message ${reply[2]} (debounce)\n`);
    }
  } catch (error) {
    fail(String(error.message || error).split('\n')[0]);
  } finally {
    if (client.isOpen) await client.close();
  }
}

main();
