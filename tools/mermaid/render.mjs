// Renders the mermaid block of every specs/*.md to SVG with mermaid-cli on Debian's
// chromium (`make docs`). Usage: node render.mjs CONFIG OUT_DIR SPEC.md...
// Writes OUT_DIR/<name>.svg and OUT_DIR/widths.json ({name: width in px at scale 1});
// exits non-zero if any diagram fails to render.
import fs from 'node:fs'
import path from 'node:path'
import puppeteer from 'puppeteer'
import { renderMermaid } from '@mermaid-js/mermaid-cli'

const [configPath, outDir, ...specs] = process.argv.slice(2)
const launch = JSON.parse(fs.readFileSync(configPath, 'utf8'))
fs.mkdirSync(outDir, { recursive: true })

function mermaidBlock (text) {
  const match = text.match(/```mermaid\n([\s\S]*?)```/)
  return match ? match[1] : null
}

const browser = await puppeteer.launch(launch)
const widths = {}
let failed = 0
async function renderOne (spec) {
  const name = path.basename(spec, '.md')
  const definition = mermaidBlock(fs.readFileSync(spec, 'utf8'))
  if (definition === null) return
  try {
    const { data } = await renderMermaid(browser, definition, 'svg', {})
    const svg = Buffer.from(data).toString('utf8')
    if (/Syntax error|No such shape/.test(svg)) throw new Error('mermaid drew an error')
    const width = svg.match(/max-width:\s*([0-9.]+)px/)
    widths[name] = width ? Number(width[1]) : null
    fs.writeFileSync(path.join(outDir, `${name}.svg`), svg)
    console.log(`rendered ${name}: ${widths[name]} px wide`)
  } catch (error) {
    failed += 1
    console.error(`FAILED ${spec}: ${error && error.message ? error.message : error}`)
  }
}
try {
  const queue = [...specs]
  const lanes = Array.from({ length: 2 }, async () => {
    while (queue.length) await renderOne(queue.shift())
  })
  await Promise.all(lanes)
} finally {
  await browser.close()
}
fs.writeFileSync(path.join(outDir, 'widths.json'), JSON.stringify(widths, null, 2) + '\n')
process.exit(failed ? 1 : 0)
